// Fused element-wise layers: residual add + RMSNorm, SiLU-and-mul, RoPE.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// ---- element-wise layers, fused ----------------------------------------------------------------
// Each is one pass over memory where torch takes three to five (and as many dispatches). The
// rounding steps follow the reference: values are rounded to the storage type wherever the
// reference's separate ops round them.
namespace {

// Rounds a float32 to the storage type and back (identity for float32).
inline float round_as(float x, const float *) { return x; }
inline float round_as(float x, const uint16_t *) {
    uint16_t b;
    store(&b, x);
    return to_f32(b);
}

// One row: xr += yr (in the storage type; yr may be null), then out = weight * round(xr / rms(xr)).
// out may be xr itself.
template <typename T>
inline void add_rms_norm_row(T *xr, const T *yr, const T *weight, T *outr, int64_t H, float eps) {
        float sq = 0.f;
        int64_t i = 0;
        Vec::reg acc = Vec::zero();
        for (; i + Vec::W <= H; i += Vec::W) {
            Vec::reg v = Vec::load(xr + i);
            if (yr) {
                v = round_as_v<Vec>(Vec::add(v, Vec::load(yr + i)), xr);
                Vec::store(xr + i, v);
            }
            acc = Vec::fmadd(v, v, acc);
        }
        sq = Vec::reduce_add(acc);
        for (; i < H; i++) {
            if (yr) store(xr + i, to_f32(xr[i]) + to_f32(yr[i]));
            sq += to_f32(xr[i]) * to_f32(xr[i]);
        }
        const float inv = 1.f / std::sqrt(sq / H + eps);
        i = 0;
        for (; i + Vec::W <= H; i += Vec::W) {
            const Vec::reg normed = round_as_v<Vec>(Vec::mul(Vec::load(xr + i), Vec::set1(inv)), xr);
            Vec::store(outr + i, Vec::mul(Vec::load(weight + i), normed));
        }
        for (; i < H; i++) store(outr + i, to_f32(weight[i]) * round_as(to_f32(xr[i]) * inv, xr));
}

// x[r] += y[r] (in the storage type), then out[r] = weight * round(x[r] / rms(x[r])).
template <typename T>
void add_rms_norm(T *x, const T *y, const T *weight, T *out, int64_t M, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (M * H >= 65536)
    for (int64_t r = 0; r < M; r++) add_rms_norm_row(x + r * H, y ? y + r * H : nullptr, weight, out + r * H, H, eps);
}

// q/k norm (Qwen3): each of the first `heads` heads (D values) of each row of x (row stride ld)
// RMS-normalised in place with one weight [D], the same row kernel as add_rms_norm's.
template <typename T>
void heads_rms_norm(T *x, int64_t ld, int64_t rows, int64_t heads, int64_t D, const T *weight, float eps) {
#pragma omp parallel for schedule(static) if (rows * heads * D >= 65536)
    for (int64_t j = 0; j < rows * heads; j++) {
        T *head = x + (j / heads) * ld + (j % heads) * D;
        add_rms_norm_row(head, static_cast<const T *>(nullptr), weight, head, D, eps);
    }
}

// x *= s, rounded to the storage type (Granite's residual multiplier on a layer's output).
template <typename T>
void scale_inplace(T *x, int64_t n, float s) {
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (int64_t i = 0; i < n; i++) store(x + i, to_f32(x[i]) * s);
}

// Both gates are g * sigmoid(a g'): SiLU's argument is g itself; gelu's tanh approximation
// 0.5 g (1 + tanh(u)) = g / (1 + e^(-2u)), u = sqrt(2 / pi) (g + 0.044715 g^3).
constexpr float kGeluC = 0.7978845608028654f, kGeluA = 0.044715f;
inline float silu(float g) { return g / (1.f + std::exp(-g)); }
inline float gelu_tanh(float g) { return g / (1.f + std::exp(-2.f * kGeluC * (g + kGeluA * g * g * g))); }

// out[r, :I] = round(act(gate)) * up, where gate_up[r] = [gate (I), up (I)]; act: SiLU, or with
// `gelu` gelu's tanh approximation (GeGLU).
template <typename T>
void silu_and_mul(const T *gate_up, T *out, int64_t M, int64_t I, bool gelu = false) {
#pragma omp parallel for schedule(static) if (M * I >= 65536)
    for (int64_t r = 0; r < M; r++) {
        const T *g = gate_up + r * 2 * I, *u = g + I;
        T *o = out + r * I;
        int64_t i = 0;
        for (; i + Vec::W <= I; i += Vec::W) {
            const Vec::reg gv = Vec::load(g + i);
            Vec::reg arg = Vec::sub(Vec::zero(), gv);       // -g, or -2u
            if (gelu)
                arg = Vec::mul(Vec::set1(-2.f * kGeluC),
                               Vec::fmadd(Vec::mul(Vec::set1(kGeluA), gv), Vec::mul(gv, gv), gv));
            const Vec::reg sv = round_as_v<Vec>(Vec::div(gv, Vec::add(Vec::set1(1.f), Vec::exp_any(arg))), o);
            Vec::store(o + i, Vec::mul(sv, Vec::load(u + i)));
        }
        for (; i < I; i++) {
            T rounded;
            store(&rounded, gelu ? gelu_tanh(to_f32(g[i])) : silu(to_f32(g[i])));
            store(o + i, to_f32(rounded) * to_f32(u[i]));
        }
    }
}
// RoPE in place on the first `heads` heads (D values each) of each row of x (row stride `ld`),
// rotate-half layout over each head's first R values (R < D: partial rotary; the rest pass):
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, with cos/sin [T, R] per token. Each product and
// the sum are rounded as the reference's separate ops round them.
template <typename T>
void rope_inplace(T *x, int64_t ld, int64_t rows, int64_t heads, int64_t D, const T *cos, const T *sin,
                  int64_t R) {
    const int64_t half = R / 2;
#pragma omp parallel for schedule(static) if (rows * heads * D >= 65536)
    for (int64_t t = 0; t < rows; t++) {
        const T *c = cos + t * R, *s = sin + t * R;
        for (int64_t h = 0; h < heads; h++) {
            T *x1 = x + t * ld + h * D, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = to_f32(x1[i]), b = to_f32(x2[i]);
                const float lo = round_as(a * to_f32(c[i]), x) + round_as(-b * to_f32(s[i]), x);
                const float hi = round_as(b * to_f32(c[half + i]), x) + round_as(a * to_f32(s[half + i]), x);
                store(x1 + i, lo);
                store(x2 + i, hi);
            }
        }
    }
}
}  // namespace

extern "C" {
int add_rms_norm_f32(float *x, const float *y, const float *w, float *out, int64_t M, int64_t H, float eps) {
    add_rms_norm(x, y, w, out, M, H, eps);
    return 0;
}
int add_rms_norm_bf16(uint16_t *x, const uint16_t *y, const uint16_t *w, uint16_t *out, int64_t M, int64_t H,
                      float eps) {
    add_rms_norm(x, y, w, out, M, H, eps);
    return 0;
}
int rope_inplace_f32(float *x, int64_t ld, int64_t rows, int64_t heads, int64_t D, const float *cos,
                     const float *sin, int64_t R) {
    rope_inplace(x, ld, rows, heads, D, cos, sin, R);
    return 0;
}
int rope_inplace_bf16(uint16_t *x, int64_t ld, int64_t rows, int64_t heads, int64_t D, const uint16_t *cos,
                      const uint16_t *sin, int64_t R) {
    rope_inplace(x, ld, rows, heads, D, cos, sin, R);
    return 0;
}
int silu_and_mul_f32(const float *gate_up, float *out, int64_t M, int64_t I) {
    silu_and_mul(gate_up, out, M, I);
    return 0;
}
int silu_and_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t M, int64_t I) {
    silu_and_mul(gate_up, out, M, I);
    return 0;
}
}
