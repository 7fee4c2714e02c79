// A prototype int4 matmul for bench/int4_dot.py: weights of 4 bits in groups of 32 along K
// (torch's `_weight_int4pack_mm_for_cpu` format: w = (q - 8) * s + z), bfloat16 activations,
// AVX512-BF16 dot products. Not used by swarmd: it measures what such a kernel would give.
//
// torch's kernel dequantizes each weight to float32 and does one float32 FMA per
// multiply-add: from 4 rows on it runs at the FMA unit's peak, so 8 rows cost twice 4.
// Here the sum over a group is split:
//   sum_k a_k w_k = sum_g s_g * sum_{k in g} a_k (q_k - 8)  +  z_g * sum_{k in g} a_k
// (q - 8) is exact in bfloat16 and a_k * (q_k - 8) exact in float32, so `vdpbf16ps` (two
// multiply-adds per lane) sums a group without rounding any weight; a group's scale and
// zero are applied once per group. Each row's arithmetic is the same whatever the number
// of rows (blocks of 8, 4, 2, 1 differ only in how many rows share a weight's unpacking).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace {

constexpr int kGroup = 32;

inline float bf16_to_float(uint16_t v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// 16 output columns from n0, for M rows. packed: this block's [K/2][16] bytes, byte j of
// pair kp holding q[n0 + j][2kp] (low nibble) and q[n0 + j][2kp + 1] (high nibble).
template <int M>
void block(const uint8_t* packed, const float* s, const float* z, const uint16_t* a,
           const float* group_sums, float* out, int K, int N, int n0) {
    // bfloat16 of q - 8 for q = 0..15, indexed by a 16-bit lane
    const __m512i lut = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
        (short)0xBF80, (short)0xC000, (short)0xC040, (short)0xC080,
        (short)0xC0A0, (short)0xC0C0, (short)0xC0E0, (short)0xC100);
    const __m512i low4 = _mm512_set1_epi32(0xF);
    const int groups = K / kGroup;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; ++g) {
        __m512 part[M];
        for (int m = 0; m < M; ++m) part[m] = _mm512_setzero_ps();
        for (int kp = g * kGroup / 2; kp < (g + 1) * kGroup / 2; ++kp) {
            __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(packed + kp * 16)));
            // each 32-bit lane: (q[2kp], q[2kp + 1]) as two 16-bit indices, then bfloat16s
            __m512i idx = _mm512_or_si512(_mm512_and_si512(bytes, low4),
                                          _mm512_slli_epi32(_mm512_srli_epi32(bytes, 4), 16));
            __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, lut);
            for (int m = 0; m < M; ++m) {
                int32_t pair;
                memcpy(&pair, a + (size_t)m * K + 2 * kp, 4);
                part[m] = _mm512_dpbf16_ps(part[m], (__m512bh)_mm512_set1_epi32(pair), w);
            }
        }
        __m512 scale = _mm512_loadu_ps(s + (size_t)g * N + n0);
        __m512 zero = _mm512_loadu_ps(z + (size_t)g * N + n0);
        for (int m = 0; m < M; ++m) {
            acc[m] = _mm512_fmadd_ps(part[m], scale, acc[m]);
            acc[m] = _mm512_fmadd_ps(zero, _mm512_set1_ps(group_sums[m * groups + g]), acc[m]);
        }
    }
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + (size_t)m * N + n0, acc[m]);
}

}  // namespace

// out[M][N] (float32) = a[M][K] (bfloat16 bits) x w^T; one thread; M <= 64, K <= 4096.
extern "C" int q4dot(const uint8_t* packed, const float* s, const float* z, const uint16_t* a,
                     float* out, int M, int K, int N) {
    const int groups = K / kGroup;
    if (M > 64 || groups * M > 64 * 128 || K % kGroup || N % 16) return -1;
    float group_sums[64 * 128];
    for (int m = 0; m < M; ++m) {
        for (int g = 0; g < groups; ++g) {
            float t = 0;
            for (int k = g * kGroup; k < (g + 1) * kGroup; ++k) t += bf16_to_float(a[(size_t)m * K + k]);
            group_sums[m * groups + g] = t;
        }
    }
    for (int nb = 0; nb < N / 16; ++nb) {
        const uint8_t* pk = packed + (size_t)nb * (K / 2) * 16;
        for (int m0 = 0; m0 < M;) {
            const uint16_t* am = a + (size_t)m0 * K;
            float* om = out + (size_t)m0 * N;
            const float* gs = group_sums + m0 * groups;
            int left = M - m0;
            if (left >= 8) { block<8>(pk, s, z, am, gs, om, K, N, nb * 16); m0 += 8; }
            else if (left >= 4) { block<4>(pk, s, z, am, gs, om, K, N, nb * 16); m0 += 4; }
            else if (left >= 2) { block<2>(pk, s, z, am, gs, om, K, N, nb * 16); m0 += 2; }
            else { block<1>(pk, s, z, am, gs, om, K, N, nb * 16); m0 += 1; }
        }
    }
    return 0;
}
