/* IEEE binary16 <-> binary32 and fp8 e4m3fn from binary32, as torch converts them (the 8-bit KV cache:
 * kvserve/model/kv_cache.py; its scales are fp16, its fp8 codes e4m3fn). Portable bit arithmetic, so
 * every CPU rounds the same way. */
#ifndef KVSERVE_HALF_H
#define KVSERVE_HALF_H
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static inline uint32_t kv_float_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    return x;
}

static inline float kv_bits_float(uint32_t x) {
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

/* binary16 -> binary32, subnormals included (exact) */
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const int sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
    float value = exponent == 0    ? ldexpf((float)mantissa, -24)
                  : exponent == 31 ? (mantissa ? NAN : INFINITY)
                                   : ldexpf((float)(mantissa | 1024), exponent - 25);
    return sign ? -value : value;
#endif
}

/* binary32 -> binary16, round to nearest even (torch's .to(float16)); overflow gives inf */
static inline uint16_t float_to_half(float f) {
    const uint32_t x = kv_float_bits(f), sign = (x >> 16) & 0x8000u;
    const uint32_t exp = x & 0x7f800000u, mant = x & 0x007fffffu;
    if (exp >= 0x47800000u) { /* |f| >= 65536, inf or NaN */
        if (exp == 0x7f800000u && mant) return (uint16_t)(sign | 0x7e00u);
        /* below inf only values that round under 65520 stay finite: none from here up */
        return (uint16_t)(sign | 0x7c00u);
    }
    if (exp <= 0x38000000u) { /* a half subnormal (or zero) */
        if (exp < 0x33000000u) return (uint16_t)sign;
        const uint32_t e = exp >> 23;
        uint32_t sig = (0x00800000u + mant) >> (113 - e);
        /* round half to even: the bits shifted out, and those below the half's last bit */
        if ((sig & 0x3fffu) != 0x1000u || (mant & 0x7ffu)) sig += 0x1000u;
        return (uint16_t)(sign + (sig >> 13));
    }
    uint32_t sig = mant;
    if ((sig & 0x3fffu) != 0x1000u) sig += 0x1000u;
    /* a carry out of the significand moves into the exponent: still right (up to inf) */
    return (uint16_t)(sign + (((exp - 0x38000000u) >> 13) + (sig >> 13)));
}

/* binary32 -> fp8 e4m3fn bits, round to nearest even, as c10's fp8e4m3fn_from_fp32_value (|f| from
 * 464 up and NaN give the NaN code 0x7f with the sign) */
static inline uint8_t float_to_e4m3(float f) {
    uint32_t bits = kv_float_bits(f);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t out;
    if (bits >= (1087u << 20)) {
        out = 0x7f;
    } else if (bits < (121u << 23)) { /* below 2^-6, the smallest normal: the denormal trick */
        const uint32_t denorm = 141u << 23;
        out = (uint8_t)(kv_float_bits(kv_bits_float(bits) + kv_bits_float(denorm)) - denorm);
    } else {
        const uint32_t odd = (bits >> 20) & 1u;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7ffffu;
        bits += odd;
        out = (uint8_t)(bits >> 20);
    }
    return (uint8_t)(out | (sign >> 24));
}
#endif
