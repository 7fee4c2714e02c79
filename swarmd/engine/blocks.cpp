// swarmd_blocks::q_mm: a matmul over GGUF's Q4_0, Q8_0, Q4_K and Q5_K blocks as the file
// holds them, on AVX2 (engine/native.py builds and loads it; linear.Blocks calls it).
//
// Why: torch's int4 kernel needs a bfloat16 scale AND zero per group of 32 (4 bytes), where
// Q4_0 has one fp16 scale (2 bytes) and a zero that is always 0: held in torch's form a
// Q4_0 model takes 1.11x the file's bytes, and decode of a model bigger than the caches
// reads every held byte once a token. These blocks are the file's own bytes (18 per 32
// weights for Q4_0, 34 for Q8_0), so a node holds and reads what the file holds.
//
// How (ggml's own method for these blocks): each row of activations is quantized to 8 bits
// per block of 32 with one float32 scale (round to nearest even), then each block's dot
// product is summed in integers (`vpmaddubsw` + `vpmaddwd`: exact) and scaled once by
// d_weight * d_activation in float32. Q4_0 matrices of a multiple of 4 rows are held
// interleaved by 4 (qtype 2, the same bytes reordered at load): one activation load, one
// scale conversion and one FMA then serve 4 rows (measured 1.4-1.6x the per-row loop, which
// spends about 6 cycles a block on one core and so is bound by arithmetic, not memory).
//
// Exactness under batching: each (row, output) sum runs over K in one fixed order in its own
// accumulators; threads split the output rows of the weights (N), never K. So a row's bits
// are the same alone and in any batch, on any number of threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kQ4Bytes = 18;  // fp16 d, then 16 bytes: value j low nibble, j + 16 high
constexpr int64_t kQ8Bytes = 34;  // fp16 d, then 32 int8 values
constexpr int64_t kRows = 4;      // activation rows sharing one pass over a weight row
// Q4_0 interleaved by 4 rows (qtype 2, `linear.Blocks` repacks at load): per group of 4
// weight rows and block of 32, the 4 fp16 scales, then the 4 rows' 16 bytes of nibbles.
constexpr int64_t kBand = 4;
constexpr int64_t kBandBytes = kBand * 2 + kBand * 16;

inline float bf16_to_float(uint16_t v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

inline float fp16_at(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// 32 signed weights of one block, as int8
template <int Q>
inline __m256i weights_of(const uint8_t* block) {
    if constexpr (Q == 0) {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
        const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
        return _mm256_sub_epi8(_mm256_and_si256(both, _mm256_set1_epi8(0x0F)),
                               _mm256_set1_epi8(8));
    } else {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
    }
}

// sum over the block of w_k * a_k, in 8 int32 lanes, as float32 (exact: |sum| < 2^24)
inline __m256 dot_block(__m256i w, __m256i a) {
    const __m256i abs_w = _mm256_sign_epi8(w, w);
    const __m256i signed_a = _mm256_sign_epi8(a, w);
    const __m256i pairs = _mm256_maddubs_epi16(abs_w, signed_a);  // |w| <= 128, |a| <= 127
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// R rows of activations (qa: int8 [R][K], da: float [R][K/32]) against one weight row
template <int Q, int R>
inline void row_dot(const uint8_t* w, const int8_t* qa, const float* da, int64_t K,
                    float* out, int64_t out_stride) {
    constexpr int64_t bytes = Q == 0 ? kQ4Bytes : kQ8Bytes;
    const int64_t groups = K / kGroup;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = w + g * bytes;
        const __m256i qw = weights_of<Q>(block);
        const float dw = fp16_at(block);
        for (int r = 0; r < R; ++r) {
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + r * K + g * kGroup));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * da[r * groups + g]), dot_block(qw, a), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]);
}

// 4 weight rows (one band) against R rows of activations. The nibbles stay unsigned
// (0..15: `vpmaddubsw` takes them as they are) and each half block's 8 * sum(a) is taken
// off after (corr: float [R][K/32][2], exact integers); the 4 rows' block sums are gathered
// into one vector by two horizontal adds, so one scale conversion, one subtraction and one
// FMA serve 4 rows. Lane r holds row r's first 16 products, lane 4 + r its last 16.
template <int R>
inline void band_dot(const uint8_t* band, const int8_t* qa, const float* da, const float* corr,
                     int64_t K, float* out, int64_t out_stride) {
    const int64_t groups = K / kGroup;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* blk = band + g * kBandBytes;
        __m256i w[kBand];
        for (int j = 0; j < kBand; ++j) {
            const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 8 + 16 * j));
            w[j] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low4);
        }
        const __m128 d4 = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
        const __m256 dw = _mm256_set_m128(d4, d4);
        for (int r = 0; r < R; ++r) {
            const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + r * K + g * kGroup));
            __m256i s[kBand];
            for (int j = 0; j < kBand; ++j) s[j] = _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], a), ones);
            const __m256i pairs = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
            const float* c = corr + (r * groups + g) * 2;
            const __m256 fix = _mm256_set_m128(_mm_set1_ps(c[1]), _mm_set1_ps(c[0]));
            const __m256 dot = _mm256_sub_ps(_mm256_cvtepi32_ps(pairs), fix);
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(da[r * groups + g])), dot, acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) {
        float lanes[8];
        _mm256_storeu_ps(lanes, acc[r]);
        for (int j = 0; j < kBand; ++j) out[r * out_stride + j] = lanes[j] + lanes[kBand + j];
    }
}

// Q4_K (Q == 3: 144 bytes) and Q5_K (Q == 4: 176 bytes) super-blocks of 256 weights: fp16 d
// and dmin, 8 sub-blocks of 32 with a 6-bit scale and a 6-bit min each (12 bytes), Q5_K's
// 32 bytes of fifth bits, then 128 bytes of nibbles (byte l of pair p: sub-block 2p's
// value l low, 2p + 1's high). A weight is d * sc * q - dmin * m with q unsigned (0..15 or
// 0..31), so a sub-block's dot product with 8-bit activations is
// d * sc * sum(q * a) - dmin * m * sum(a): `vpmaddubsw` takes q as it is, and the min's
// part comes from each activation block's integer sum (asum), both exact before scaling.
constexpr int64_t kSuper = 256;

template <int Q>
inline void k_scales(const uint8_t* b, float* sc, float* mn) {
    const float d = fp16_at(b), dmin = fp16_at(b + 2);
    const uint8_t* s = b + 4;
    for (int j = 0; j < 8; ++j) {
        int scale, min;
        if (j < 4) {
            scale = s[j] & 63;
            min = s[j + 4] & 63;
        } else {
            scale = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
            min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        }
        sc[j] = d * static_cast<float>(scale);
        mn[j] = dmin * static_cast<float>(min);
    }
}

template <int Q, int R>
inline void k_row_dot(const uint8_t* w, const int8_t* qa, const float* da, const float* asum,
                      int64_t K, float* out, int64_t out_stride) {
    constexpr int64_t bytes = Q == 3 ? 144 : 176;
    const int64_t supers = K / kSuper, groups = K / kGroup;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i one = _mm256_set1_epi8(1);
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256 acc[R];
    float mins[R];
    for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_setzero_ps();
        mins[r] = 0.0f;
    }
    for (int64_t s = 0; s < supers; ++s) {
        const uint8_t* b = w + s * bytes;
        float sc[8], mn[8];
        k_scales<Q>(b, sc, mn);
        const uint8_t* qs = b + (Q == 3 ? 16 : 48);
        __m256i high = _mm256_setzero_si256();
        if constexpr (Q == 4) high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
        for (int p = 0; p < 4; ++p) {
            const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * p));
            __m256i q0 = _mm256_and_si256(packed, low4);
            __m256i q1 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
            if constexpr (Q == 4) {
                // bit 2p (2p + 1) of byte l is value l's fifth bit in sub-block 2p (2p + 1)
                const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(high, 2 * p), one);
                const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(high, 2 * p + 1), one);
                q0 = _mm256_or_si256(q0, _mm256_slli_epi16(h0, 4));
                q1 = _mm256_or_si256(q1, _mm256_slli_epi16(h1, 4));
            }
            const int64_t g0 = s * 8 + 2 * p, g1 = g0 + 1;
            for (int r = 0; r < R; ++r) {
                const int8_t* a = qa + r * K;
                const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + g0 * kGroup));
                const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + g1 * kGroup));
                const __m256 dot0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q0, a0), ones16));
                const __m256 dot1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(q1, a1), ones16));
                const float d0 = da[r * groups + g0], d1 = da[r * groups + g1];
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(sc[2 * p] * d0), dot0, acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(sc[2 * p + 1] * d1), dot1, acc[r]);
                mins[r] += mn[2 * p] * d0 * asum[r * groups + g0] + mn[2 * p + 1] * d1 * asum[r * groups + g1];
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r * out_stride] = hsum(acc[r]) - mins[r];
}

// the integer sum of each block of 32 quantized activations: [M][K/32]
void block_sums(const int8_t* q, int64_t M, int64_t K, float* sums) {
    for (int64_t i = 0; i < M * K / kGroup; ++i) {
        int32_t total = 0;
        for (int64_t k = 0; k < kGroup; ++k) total += q[i * kGroup + k];
        sums[i] = static_cast<float>(total);
    }
}

// activations [M, K] bfloat16 -> int8 [M, K] and a float32 scale per block of 32
void quantize_rows(const uint16_t* x, int64_t M, int64_t K, int8_t* q, float* d) {
    const int64_t groups = K / kGroup;
    for (int64_t i = 0; i < M * groups; ++i) {
        const uint16_t* src = x + i * kGroup;
        float values[kGroup];
        float amax = 0.0f;
        for (int64_t k = 0; k < kGroup; ++k) {
            values[k] = bf16_to_float(src[k]);
            amax = std::max(amax, std::fabs(values[k]));
        }
        const float scale = amax / 127.0f;
        const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int64_t k = 0; k < kGroup; ++k) {
            q[i * kGroup + k] = static_cast<int8_t>(std::nearbyint(values[k] * inverse));
        }
        d[i] = scale;
    }
}

// R activation rows against one weight row of qtype Q (asum: only the K-quants' mins use it)
template <int Q, int R>
inline void dot_rows(const uint8_t* w, const int8_t* qa, const float* da, const float* asum,
                     int64_t K, float* out, int64_t out_stride) {
    if constexpr (Q >= 3) {
        k_row_dot<Q, R>(w, qa, da, asum, K, out, out_stride);
    } else {
        row_dot<Q, R>(w, qa, da, K, out, out_stride);
    }
}

template <int Q>
void each_row(const uint8_t* w, int64_t row_bytes, const int8_t* qa, const float* da,
              const float* asum, int64_t M, int64_t K, int64_t N, float* out) {
    const int64_t groups = K / kGroup;
    // a task: at least ~256k multiply-adds, so small matrices do not pay for a thread
    const int64_t grain = std::max<int64_t>(1, 262144 / std::max<int64_t>(1, K * M));
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
            const uint8_t* row = w + n * row_bytes;
            int64_t m = 0;
            for (; m + kRows <= M; m += kRows)
                dot_rows<Q, kRows>(row, qa + m * K, da + m * groups, asum + m * groups, K, out + m * N + n, N);
            for (; m + 2 <= M; m += 2)
                dot_rows<Q, 2>(row, qa + m * K, da + m * groups, asum + m * groups, K, out + m * N + n, N);
            for (; m < M; ++m)
                dot_rows<Q, 1>(row, qa + m * K, da + m * groups, asum + m * groups, K, out + m * N + n, N);
        }
    });
}

// 8 * sum of each half block of the quantized activations: [M][K/32][2]
void half_sums(const int8_t* q, int64_t M, int64_t K, float* corr) {
    for (int64_t i = 0; i < M * K / kGroup; ++i) {
        int32_t lo = 0, hi = 0;
        for (int64_t k = 0; k < kGroup / 2; ++k) lo += q[i * kGroup + k];
        for (int64_t k = kGroup / 2; k < kGroup; ++k) hi += q[i * kGroup + k];
        corr[2 * i] = 8.0f * static_cast<float>(lo);
        corr[2 * i + 1] = 8.0f * static_cast<float>(hi);
    }
}

void each_band(const uint8_t* w, const int8_t* qa, const float* da, const float* corr, int64_t M,
               int64_t K, int64_t N, float* out) {
    const int64_t groups = K / kGroup;
    const int64_t band_bytes = groups * kBandBytes;
    const int64_t grain = std::max<int64_t>(1, 262144 / std::max<int64_t>(1, K * M * kBand));
    at::parallel_for(0, N / kBand, grain, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
            const uint8_t* band = w + b * band_bytes;
            float* o = out + b * kBand;
            int64_t m = 0;
            for (; m + kRows <= M; m += kRows)
                band_dot<kRows>(band, qa + m * K, da + m * groups, corr + m * groups * 2, K, o + m * N, N);
            for (; m + 2 <= M; m += 2)
                band_dot<2>(band, qa + m * K, da + m * groups, corr + m * groups * 2, K, o + m * N, N);
            for (; m < M; ++m)
                band_dot<1>(band, qa + m * K, da + m * groups, corr + m * groups * 2, K, o + m * N, N);
        }
    });
}

at::Tensor q_mm(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x: bfloat16 [M, K]");
    TORCH_CHECK(qtype >= 0 && qtype <= 4,
                "qtype: 0 (Q4_0), 1 (Q8_0), 2 (Q4_0 by 4 rows), 3 (Q4_K) or 4 (Q5_K)");
    TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte, "blocks: uint8 [N, bytes]");
    const int64_t M = x.size(0), K = x.size(1);
    const int64_t N = qtype == 2 ? blocks.size(0) * kBand : blocks.size(0);
    const bool k_quant = qtype >= 3;
    const int64_t unit = k_quant ? kSuper : kGroup;  // weights a block holds
    const int64_t bytes = qtype == 0   ? kQ4Bytes
                          : qtype == 1 ? kQ8Bytes
                          : qtype == 2 ? kBandBytes
                          : qtype == 3 ? 144
                                       : 176;
    TORCH_CHECK(K % unit == 0 && blocks.size(1) == K / unit * bytes,
                "K must be a multiple of the block (32, or 256 for K-quants) and match the blocks");
    const at::Tensor xc = x.contiguous(), bc = blocks.contiguous();
    at::Tensor out = at::empty({M, N}, x.options());
    if (M == 0 || N == 0) return out;
    at::Tensor qa = at::empty({M, K}, x.options().dtype(at::kChar));
    at::Tensor da = at::empty({M, K / kGroup}, x.options().dtype(at::kFloat));
    quantize_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), M, K,
                  qa.data_ptr<int8_t>(), da.data_ptr<float>());
    at::Tensor sums = at::empty({M, N}, x.options().dtype(at::kFloat));
    if (qtype == 2) {
        at::Tensor corr = at::empty({M, K / kGroup, 2}, x.options().dtype(at::kFloat));
        half_sums(qa.data_ptr<int8_t>(), M, K, corr.data_ptr<float>());
        each_band(bc.data_ptr<uint8_t>(), qa.data_ptr<int8_t>(), da.data_ptr<float>(),
                  corr.data_ptr<float>(), M, K, N, sums.data_ptr<float>());
    } else {
        at::Tensor asum = at::empty({k_quant ? M : 0, K / kGroup}, x.options().dtype(at::kFloat));
        if (k_quant) block_sums(qa.data_ptr<int8_t>(), M, K, asum.data_ptr<float>());
        auto run = qtype == 0 ? each_row<0> : qtype == 1 ? each_row<1> : qtype == 3 ? each_row<3> : each_row<4>;
        run(bc.data_ptr<uint8_t>(), K / unit * bytes, qa.data_ptr<int8_t>(), da.data_ptr<float>(),
            asum.data_ptr<float>(), M, K, N, sums.data_ptr<float>());
    }
    const float* s = sums.data_ptr<float>();
    uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < M * N; ++i) o[i] = float_to_bf16(s[i]);
    return out;
}

// Q6_K rows (uint8 [N, K / 256 * 210]) -> int8 [N, K] with one float32 scale per row: the
// very arithmetic of gguf's numpy dequantization (w = (d * scale) * (q - 32) in float32)
// and `model.quant.quantize_int8` (scale = max|w| / 127, q = round-half-even(w / scale)),
// in one pass per row on torch's threads instead of several passes over the whole matrix
// (a Llama-8B head: about 18 s in numpy and torch).
std::tuple<at::Tensor, at::Tensor> q6_k_to_int8(const at::Tensor& blocks, int64_t K) {
    constexpr int64_t kSuperBytes = 210;
    TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte, "blocks: uint8 [N, bytes]");
    TORCH_CHECK(K % kSuper == 0 && blocks.size(1) == K / kSuper * kSuperBytes,
                "K must be a multiple of 256 and match the blocks");
    const at::Tensor bc = blocks.contiguous();
    const int64_t N = bc.size(0), row_bytes = bc.size(1);
    at::Tensor values = at::empty({N, K}, bc.options().dtype(at::kChar));
    at::Tensor scales = at::empty({N}, bc.options().dtype(at::kFloat));
    const uint8_t* src = bc.data_ptr<uint8_t>();
    int8_t* dst = values.data_ptr<int8_t>();
    float* sc_out = scales.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> w(K);
        for (int64_t n = begin; n < end; ++n) {
            const uint8_t* row = src + n * row_bytes;
            float amax = 0.0f;
            for (int64_t s = 0; s < K / kSuper; ++s) {
                const uint8_t* b = row + s * kSuperBytes;
                const uint8_t* ql = b;
                const uint8_t* qh = b + 128;
                const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
                const float d = fp16_at(b + 208);
                for (int64_t e = 0; e < kSuper; ++e) {
                    const int64_t h = e >> 7, r = (e & 127) >> 5, l = e & 31;
                    const uint8_t byte = ql[h * 64 + (r & 1) * 32 + l];
                    const int lo = (r >> 1) ? (byte >> 4) : (byte & 0x0F);
                    const int hi = (qh[h * 32 + l] >> (2 * r)) & 3;
                    const float dsc = d * static_cast<float>(sc[e >> 4]);
                    const float v = dsc * static_cast<float>((lo | (hi << 4)) - 32);
                    w[s * kSuper + e] = v;
                    amax = std::max(amax, std::fabs(v));
                }
            }
            const float scale = amax / 127.0f;
            const float safe = scale > 0.0f ? scale : 1.0f;
            for (int64_t k = 0; k < K; ++k) {
                const float q = std::nearbyint(w[k] / safe);
                dst[n * K + k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
            }
            sc_out[n] = scale;
        }
    });
    return {values, scales};
}

}  // namespace

TORCH_LIBRARY(swarmd_blocks, m) {
    m.def("q_mm(Tensor x, Tensor blocks, int qtype) -> Tensor");
    m.def("q6_k_to_int8(Tensor blocks, int k) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(swarmd_blocks, CPU, m) {
    m.impl("q_mm", q_mm);
    m.impl("q6_k_to_int8", q6_k_to_int8);
}
