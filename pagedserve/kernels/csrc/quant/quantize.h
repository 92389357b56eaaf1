// Float rows -> q8_0 / q4_0 blocks (quant_quantize).
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// out [rows][ldo bytes] = x [rows][ldx] (float32 or bf16) in q8_0 or q4_0 blocks, llama.cpp's
// reference rounding as gguf.quants computes it (q4_0's value in double, then float, then
// truncated: -ffp-contract=off keeps it unfused). 0 on success.
extern "C" int quant_quantize(int qt, const void *x, int64_t ldx, int x_bf16, int64_t rows, int64_t cols,
                              uint8_t *out, int64_t ldo) {
    if ((qt != Q8_0 && qt != Q4_0) || cols % 32) return 1;
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        float v[32];
        for (int64_t j = 0; j < cols / 32; j++) {
            for (int i = 0; i < 32; i++)
                v[i] = x_bf16 ? bf16_to_f32(static_cast<const uint16_t *>(x)[r * ldx + j * 32 + i])
                              : static_cast<const float *>(x)[r * ldx + j * 32 + i];
            uint8_t *b = out + r * ldo + j * kBytes[qt];
            if (qt == Q8_0) {
                float amax = 0.f;
                for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs(v[i]));
                const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
                const uint16_t h = f32_to_f16(d);
                std::memcpy(b, &h, 2);
                for (int i = 0; i < 32; i++) b[2 + i] = uint8_t(int8_t(std::round(v[i] * id)));
            } else {
                int imax = 0;                    // the first element of largest magnitude, with its sign
                for (int i = 1; i < 32; i++)
                    if (std::fabs(v[i]) > std::fabs(v[imax])) imax = i;
                const float d = v[imax] / -8.f, id = d != 0.f ? 1.f / d : 0.f;
                const uint16_t h = f32_to_f16(d);
                std::memcpy(b, &h, 2);
                int q[32];
                for (int i = 0; i < 32; i++) {
                    const float t = std::trunc(float(double(v[i]) * double(id) + 8.5));
                    q[i] = std::min(15, int(t));
                }
                for (int i = 0; i < 16; i++) b[2 + i] = uint8_t(q[i] | (q[i + 16] << 4));
            }
        }
    }
    return 0;
}

// The super-block activations (activations.h's quantize_super) of x [rows][ldx] (float32 or bf16):
// q [rows][cols], d [rows][cols / 256], bs [rows][cols / 16]; the tests' view of what the super-block
// r8 kernels multiply. 0 on success.
extern "C" int quant_quantize_super(const void *x, int64_t ldx, int x_bf16, int64_t rows, int64_t cols, int8_t *q,
                                    float *d, int16_t *bs) {
    if (cols % 256 || rows < 0) return 1;
    const Act a{nullptr, nullptr, nullptr, cols, cols / 32, {}, nullptr, q, d, bs};
    for (int64_t i = 0; i < rows * (cols / 256); i++) quantize_super_one(x, ldx, x_bf16 != 0, i / (cols / 256), i % (cols / 256), a);
    return 0;
}
