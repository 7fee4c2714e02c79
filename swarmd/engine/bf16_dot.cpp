// swarmd::int4_bf16_mm and swarmd::int8_bf16_mm: int4 and int8 matmuls on AVX512-BF16 dot
// products (engine/native.py builds and loads them; linear.Int4Dot / Int8Dot call them).
//
// int4 weights: 4-bit q in groups of 32 along K, w = (q - 8) * scale + zero; int8: w = q *
// scale per output row (the forms of model/quant.py). Activations and outputs: bfloat16.
//
// Why not torch's `_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm`: they turn every
// weight into float32 and do one float32 FMA per multiply-add, so from 4 rows on they run at
// the FMA units' peak and a decode step of 8 sessions costs twice one of 4
// (bench/quant_kernels.py). `vdpbf16ps` does two multiply-adds a lane. For int4 a group's
// sum is split as
//   sum_k a_k w_k = scale_g * sum_{k in g} a_k (q_k - 8)  +  zero_g * sum_{k in g} a_k
// (q - 8) is exact in bfloat16 and a_k * (q_k - 8) exact in float32, so `vdpbf16ps` (two
// multiply-adds a lane) sums a group without rounding any weight, and a group's scale and
// zero apply once. int8 values are exact in bfloat16 too. Scales and zeros stay float32
// (torch's kernels round them to bfloat16).
//
// Exactness under batching: each row has its own accumulators and the same order of adds
// whatever the number of rows or threads (threads split the output columns, never K), so a
// row's bits are the same alone and in any batch.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

// native.py holds the same numbers (COLUMNS) and the op's schema (SCHEMA).
constexpr int64_t kGroup = 32;
constexpr int64_t kCols = 16;  // output columns per block: one 512-bit register of float32

inline float bf16_to_float(uint16_t v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// M rows x 16 output columns from n0. packed: this block's [K/2][16] bytes, byte j of pair
// kp holding q[n0 + j][2kp] (low nibble) and q[n0 + j][2kp + 1] (high nibble).
template <int M>
void block(const uint8_t* packed, const float* scale, const float* zero, const uint16_t* a,
           const float* sums, uint16_t* out, int64_t K, int64_t N, int64_t n0) {
    // bfloat16 of q - 8 for q = 0..15, indexed by a 16-bit lane
    const __m512i lut = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
        (short)0xBF80, (short)0xC000, (short)0xC040, (short)0xC080,
        (short)0xC0A0, (short)0xC0C0, (short)0xC0E0, (short)0xC100);
    const __m512i low4 = _mm512_set1_epi32(0xF);
    const int64_t groups = K / kGroup;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        __m512 part[M];
        for (int m = 0; m < M; ++m) part[m] = _mm512_setzero_ps();
        for (int64_t kp = g * kGroup / 2; kp < (g + 1) * kGroup / 2; ++kp) {
            __m512i bytes = _mm512_cvtepu8_epi32(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + kp * kCols)));
            // each 32-bit lane: (q[2kp], q[2kp + 1]) as two 16-bit indices, then bfloat16s
            __m512i idx = _mm512_or_si512(_mm512_and_si512(bytes, low4),
                                          _mm512_slli_epi32(_mm512_srli_epi32(bytes, 4), 16));
            __m512bh w = (__m512bh)_mm512_permutexvar_epi16(idx, lut);
            for (int m = 0; m < M; ++m) {
                int32_t pair;
                std::memcpy(&pair, a + m * K + 2 * kp, 4);
                part[m] = _mm512_dpbf16_ps(part[m], (__m512bh)_mm512_set1_epi32(pair), w);
            }
        }
        __m512 s = _mm512_loadu_ps(scale + g * N + n0);
        __m512 z = _mm512_loadu_ps(zero + g * N + n0);
        for (int m = 0; m < M; ++m) {
            acc[m] = _mm512_fmadd_ps(part[m], s, acc[m]);
            acc[m] = _mm512_fmadd_ps(z, _mm512_set1_ps(sums[m * groups + g]), acc[m]);
        }
    }
    for (int m = 0; m < M; ++m) {
        __m256bh rounded = _mm512_cvtneps_pbh(acc[m]);  // round to nearest even, as torch
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * N + n0), (__m256i)rounded);
    }
}

// run(rows, nb, m0) with `rows` = std::integral_constant<int, R>: one call per R, so the
// row count is a compile-time constant (the accumulators stay in registers).
template <int R, typename Run>
inline void rows_from(int64_t left, const Run& run, int64_t nb, int64_t m0) {
    if constexpr (R > 1) {
        if (left < R) return rows_from<R - 1>(left, run, nb, m0);
    }
    run(std::integral_constant<int, R>{}, nb, m0);
}

// Every (block of 16 output columns, block of up to 8 rows) of an [M, N] product, the
// column blocks split among torch's threads. Any 1-8 rows are one pass over a block's
// weights: 7 rows as 4 + 2 + 1 would unpack every weight three times (a step of 7 sessions
// then cost half as much again as one of 8).
template <typename Run>
void each_block(int64_t M, int64_t K, int64_t N, const Run& run) {
    // a task: at least ~64k multiply-adds, so small matrices do not pay for a thread
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, K * kCols * M));
    at::parallel_for(0, N / kCols, grain, [&](int64_t begin, int64_t end) {
        for (int64_t nb = begin; nb < end; ++nb) {
            for (int64_t m0 = 0; m0 < M; m0 += 8) rows_from<8>(M - m0, run, nb, m0);
        }
    });
}

at::Tensor int4_bf16_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                        const at::Tensor& zero) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bfloat16 [M, K]");
    TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == kCols,
                "packed: uint8 [N/16, K/2, 16]");
    const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kCols;
    TORCH_CHECK(K % kGroup == 0 && packed.size(1) * 2 == K, "K must be a multiple of 32 and match");
    for (const at::Tensor* t : {&scale, &zero}) {
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == K / kGroup &&
                        t->size(1) == N,
                    "scale and zero: float32 [K/32, N]");
    }
    const at::Tensor xc = x.contiguous();
    const at::Tensor pc = packed.contiguous(), sc = scale.contiguous(), zc = zero.contiguous();
    at::Tensor out = at::empty({M, N}, x.options());
    if (M == 0) return out;
    const int64_t groups = K / kGroup;
    const uint16_t* a = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    // each row's sum of activations per group (the zero's term), in a fixed order
    at::Tensor sums_t = at::empty({M, groups}, x.options().dtype(at::kFloat));
    float* sums = sums_t.data_ptr<float>();
    for (int64_t i = 0; i < M * groups; ++i) {
        float t = 0;
        for (int64_t k = 0; k < kGroup; ++k) t += bf16_to_float(a[i * kGroup + k]);
        sums[i] = t;
    }
    const uint8_t* p = pc.data_ptr<uint8_t>();
    const float* s = sc.data_ptr<float>();
    const float* z = zc.data_ptr<float>();
    uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    each_block(M, K, N, [&](auto rows, int64_t nb, int64_t m0) {
        block<decltype(rows)::value>(p + nb * (K / 2) * kCols, s, z, a + m0 * K,
                                     sums + m0 * groups, o + m0 * N, K, N, nb * kCols);
    });
    return out;
}

// M rows x 16 output columns from n0 of an int8 matrix. packed: this block's [K/2][16][2]
// bytes, q[n0 + j][2kp] and q[n0 + j][2kp + 1] side by side. int8 values are exact in
// bfloat16, so the sum over K is float32 products of exact weights.
template <int M>
void block8(const int8_t* packed, const float* scale, const uint16_t* a, uint16_t* out,
            int64_t K, int64_t N, int64_t n0) {
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < K / 2; ++kp) {
        const int8_t* q = packed + kp * 2 * kCols;
        // columns 0-7's pairs, then 8-15's: float32, then one register of 32 bfloat16s
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
        __m512 hi = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(q + kCols))));
        __m512bh w = _mm512_cvtne2ps_pbh(hi, lo);
        for (int m = 0; m < M; ++m) {
            int32_t pair;
            std::memcpy(&pair, a + m * K + 2 * kp, 4);
            acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(pair), w);
        }
    }
    __m512 s = _mm512_loadu_ps(scale + n0);
    for (int m = 0; m < M; ++m) {
        __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[m], s));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * N + n0), (__m256i)rounded);
    }
}

at::Tensor int8_bf16_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bfloat16 [M, K]");
    TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar &&
                    packed.size(2) == kCols && packed.size(3) == 2,
                "packed: int8 [N/16, K/2, 16, 2]");
    const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kCols;
    TORCH_CHECK(K % 2 == 0 && packed.size(1) * 2 == K, "K must be even and match the weights");
    TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.dim() == 1 && scale.size(0) == N,
                "scale: float32 [N]");
    const at::Tensor xc = x.contiguous(), pc = packed.contiguous(), sc = scale.contiguous();
    at::Tensor out = at::empty({M, N}, x.options());
    if (M == 0) return out;
    const uint16_t* a = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
    const int8_t* p = pc.data_ptr<int8_t>();
    const float* s = sc.data_ptr<float>();
    uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    each_block(M, K, N, [&](auto rows, int64_t nb, int64_t m0) {
        block8<decltype(rows)::value>(p + nb * K * kCols, s, a + m0 * K, o + m0 * N, K, N,
                                      nb * kCols);
    });
    return out;
}

}  // namespace

TORCH_LIBRARY(swarmd, m) {
    m.def("int4_bf16_mm(Tensor x, Tensor packed, Tensor scale, Tensor zero) -> Tensor");
    m.def("int8_bf16_mm(Tensor x, Tensor packed, Tensor scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(swarmd, CPU, m) {
    m.impl("int4_bf16_mm", int4_bf16_mm);
    m.impl("int8_bf16_mm", int8_bf16_mm);
}
