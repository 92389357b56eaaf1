// Greedy sampling's argmax over rows.
// Part of cpu_kernels (csrc/cpu_kernels.cpp includes its rooms in order; each sees those before it).
#pragma once

// ---- greedy sampling: the first maximum of each row ------------------------------------------
// As torch's max(dim=-1).indices (a NaN counts as the maximum), which on CPU compares one
// element at a time: 1.3-2.2 ms for 64 rows of a 49k vocabulary, 2-3% of a batch-64 decode step.
// Two vector passes over a row (in L2 for the second): its maximum, then where it first is.
extern "C" int argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * cols;
        float best = -INFINITY;
        bool nan = false;
        int64_t i = 0;
#ifdef __AVX512F__
        __m512 mx = _mm512_set1_ps(-INFINITY);
        __mmask16 unordered = 0;
        for (; i + 16 <= cols; i += 16) {
            const __m512 v = _mm512_loadu_ps(xr + i);
            unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            mx = _mm512_max_ps(mx, v);
        }
        best = _mm512_reduce_max_ps(mx);
        nan = unordered != 0;
#elif defined(__AVX2__)
        __m256 mx = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
        for (; i + 8 <= cols; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            mx = _mm256_max_ps(mx, v);
        }
        best = V8::reduce_max(mx);
        nan = _mm256_movemask_ps(unordered) != 0;
#endif
        for (; i < cols; i++) {
            nan |= std::isnan(xr[i]);
            best = std::max(best, xr[i]);
        }
        i = 0;
#ifdef __AVX512F__
        const __m512 target = _mm512_set1_ps(best);
        for (; i + 16 <= cols; i += 16) {   // stop at the first group of 16 that holds it
            const __m512 v = _mm512_loadu_ps(xr + i);
            if (nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ)) break;
        }
#elif defined(__AVX2__)
        const __m256 target = _mm256_set1_ps(best);
        for (; i + 8 <= cols; i += 8) {
            const __m256 v = _mm256_loadu_ps(xr + i);
            if (_mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, target, _CMP_EQ_OQ))) break;
        }
#endif
        while (i < cols && !(nan ? std::isnan(xr[i]) : xr[i] == best)) i++;
        out[r] = i < cols ? i : 0;
    }
    return 0;
}
