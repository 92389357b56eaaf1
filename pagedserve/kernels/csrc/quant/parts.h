// QuantPart: a weight or one row-stacked part of it.
// Part of quant_kernels (csrc/quant_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// A weight, or one part of weights stacked by rows (a fused projection stored apart, each part
// in its own type): `rows` rows of blocks of type qtype, ldw bytes apart.
struct QuantPart {
    int64_t qtype;
    const uint8_t *w;
    int64_t ldw, rows;
};

namespace {
bool valid(const QuantPart *parts, int64_t nparts, int64_t K) {
    for (int64_t p = 0; p < nparts; p++)
        if (parts[p].qtype < 0 || parts[p].qtype >= kNumTypes || K % kElems[parts[p].qtype] || parts[p].rows < 0)
            return false;
    return nparts > 0;
}

// Whether a part is MXFP4 (quant/mxfp4.h): the AMX paths and the bf16 packers have no MXFP4
// decoder, so those calls take the generic paths.
bool any_mxfp4(const QuantPart *parts, int64_t nparts) {
    for (int64_t p = 0; p < nparts; p++)
        if (parts[p].qtype == MXFP4) return true;
    return false;
}
}  // namespace
