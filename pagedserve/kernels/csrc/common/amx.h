// Whether this process may use AMX tiles with one more AMX feature: CPUID has amx-tile and that
// feature (its bit of CPUID.(7, 0).EDX: kAmxBf16 or kAmxInt8), and the kernel grants the process
// tile data (arch_prctl(ARCH_REQ_XCOMP_PERM), once per process is enough; asking again is harmless).
// Shared by cpu_kernels (the AMX-BF16 GEMM) and quant_kernels (AMX-INT8 dots, AMX-BF16 weight tiles).
#pragma once

#if defined(__AVX512BF16__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))
namespace {
constexpr unsigned kAmxBf16 = 22, kAmxInt8 = 25;     // CPUID.(EAX=7, ECX=0):EDX bits; amx-tile is 24

bool amx_permitted(unsigned feature_bit) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << feature_bit))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}
}  // namespace
#endif
