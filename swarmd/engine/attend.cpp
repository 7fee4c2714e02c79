// swarmd::attend: the attention of query rows over float32 KV caches, each row over the
// positions [lo, hi) of its own cache (engine/native.py builds it with bf16_dot.cpp;
// stage.py and scripted.py call it for prompt chunks and decode steps alike).
//
// Why not torch's bmm + softmax (engine/attention.py): a decode step of 8 sessions spent
// more time in 60 small batched matmuls, their masks and the KV writes (~7.7 ms of a 24 ms
// step, 2 threads) than in any matrix of the model; and bmm's bits depend on its shapes,
// so attention.py pads and blocks every query to shapes measured to round alike.
//
// Here a query's result depends on nothing but its own q and the keys and values it sees:
// every (row, KV head) is computed alone, in one fixed order of adds:
//   s_j = sum_d (q_d * scale) k_jd      (16 lanes, then one fixed reduction)
//   w_j = exp(s_j - max_j s_j)          (exp_ps below, vectorized from lo in steps of 16)
//   out = (sum_j w_j v_j) / (sum_j w_j)
// So a position gets the same bits in a prompt chunk of any size, in a decode step alone
// or batched with any others, on any thread count: exactness by construction, with no
// padding and no masked keys computed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;

// e^x for x <= 0, 16 lanes (Cephes' expf: range reduction by ln 2, a degree-5 polynomial,
// about 1 ulp). Lanes below -87.3 give about 0, as their weight should be.
inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

// The sums of 16 vectors' lanes: lane j of the result is the sum of a[j]'s 16 lanes, in one
// fixed order (pairs of lanes, then of pairs, ...): 15 adds for 16 sums.
inline __m512 sum16(__m512* a) {
    __m512 t[8];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    __m512 u[4];
    for (int i = 0; i < 4; ++i) {
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    // u[i]: per 128-bit lane L, partial sums of keys 4i..4i+3; add the 4 lanes up
    const __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88),
                                   _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88),
                                   _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(v, w, 0x88), _mm512_shuffle_f32x4(v, w, 0xDD));
}

// One query head over keys/values rows [lo, hi) (row j at keys + j * stride), C = D / 16
// vectors a row; q already scaled. scores: room for hi - lo rounded up to 16 floats.
// out: D floats.
template <int C>
void attend_head(const float* q, const float* keys, const float* values, int64_t stride,
                 int64_t lo, int64_t hi, float* scores, float* out) {
    __m512 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(q + c * kLanes);
    const int64_t n = hi - lo;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, n - j0);
        __m512 acc[kLanes];
        for (int64_t j = 0; j < kLanes; ++j) {
            if (j >= count) {
                acc[j] = _mm512_setzero_ps();
                continue;
            }
            const float* k = keys + (lo + j0 + j) * stride;
            __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
            for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + c * kLanes), a);
            acc[j] = a;
        }
        const __mmask16 m = count == kLanes ? 0xFFFF : (__mmask16)((1u << count) - 1);
        const __m512 s = sum16(acc);
        _mm512_storeu_ps(scores + j0, s);
        top = _mm512_mask_max_ps(top, m, top, s);
    }
    const __m512 topv = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
        const int64_t count = std::min<int64_t>(kLanes, n - j0);
        const __mmask16 m = count == kLanes ? 0xFFFF : (__mmask16)((1u << count) - 1);
        const __m512 w = _mm512_maskz_mov_ps(
            m, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + j0), topv)));
        _mm512_storeu_ps(scores + j0, w);
        total = _mm512_add_ps(total, w);
    }
    // two sets of sums (even and odd keys), so the adds of consecutive keys overlap
    __m512 even[C], odd[C];
    for (int c = 0; c < C; ++c) even[c] = odd[c] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 1 < n; j += 2) {
        const float* v = values + (lo + j) * stride;
        const __m512 w0 = _mm512_set1_ps(scores[j]), w1 = _mm512_set1_ps(scores[j + 1]);
        for (int c = 0; c < C; ++c) {
            even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v + c * kLanes), even[c]);
            odd[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(v + stride + c * kLanes), odd[c]);
        }
    }
    if (j < n) {
        const float* v = values + (lo + j) * stride;
        const __m512 w0 = _mm512_set1_ps(scores[j]);
        for (int c = 0; c < C; ++c) even[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(v + c * kLanes), even[c]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total));
    for (int c = 0; c < C; ++c)
        _mm512_storeu_ps(out + c * kLanes, _mm512_mul_ps(_mm512_add_ps(even[c], odd[c]), inv));
}

using HeadFn = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t,
                        float*, float*);

template <size_t... I>
HeadFn pick(int64_t vectors, std::index_sequence<I...>) {
    HeadFn fn = nullptr;
    ((vectors == (int64_t)I + 1 ? (fn = attend_head<I + 1>, 0) : 0), ...);
    return fn;
}

// Head dims 16, 32, ..., 256 (native.py's attend_fits).
HeadFn head_fn(int64_t head_dim) {
    if (head_dim % kLanes != 0) return nullptr;
    return pick(head_dim / kLanes, std::make_index_sequence<16>{});
}

// q: float32 [R, heads, D]. new_kv: float32 [2, R, kv, D] (row r's key and value, written
// at position hi[r] - 1 of its cache first) or empty (the caches hold them already).
// caches: float32 [layers, 2, 1, kv, capacity, D] each (a KV slot, kv.py), `layer` the
// one read; row r reads caches[which[r]] at positions [lo[r], hi[r]). Returns [R, heads, D].
at::Tensor attend(const at::Tensor& q, const at::Tensor& new_kv, at::TensorList caches,
                  int64_t layer, at::IntArrayRef which, at::IntArrayRef lo, at::IntArrayRef hi,
                  double scale) {
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q: float32 [rows, heads, D]");
    const int64_t rows = q.size(0), heads = q.size(1), head_dim = q.size(2);
    TORCH_CHECK(which.size() == (size_t)rows && lo.size() == (size_t)rows &&
                    hi.size() == (size_t)rows,
                "which, lo and hi: one per row");
    const HeadFn fn = head_fn(head_dim);
    TORCH_CHECK(fn != nullptr, "head dim must be a multiple of 16 up to 256");
    TORCH_CHECK(!caches.empty(), "no caches");
    const int64_t kv_heads = caches[0].dim() == 6 ? caches[0].size(3) : 0;
    TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of KV heads");
    for (const at::Tensor& c : caches) {
        TORCH_CHECK(c.dim() == 6 && c.scalar_type() == at::kFloat && c.size(1) == 2 &&
                        c.size(2) == 1 && c.size(3) == kv_heads && c.size(5) == head_dim &&
                        c.stride(5) == 1 && c.stride(4) == head_dim,
                    "caches: float32 [layers, 2, 1, kv, capacity, D], rows of D contiguous");
        TORCH_CHECK(layer >= 0 && layer < c.size(0), "layer out of range");
    }
    const bool writes = new_kv.numel() > 0;
    if (writes) {
        TORCH_CHECK(new_kv.scalar_type() == at::kFloat && new_kv.dim() == 4 &&
                        new_kv.size(0) == 2 && new_kv.size(1) == rows &&
                        new_kv.size(2) == kv_heads && new_kv.size(3) == head_dim,
                    "new_kv: float32 [2, rows, kv, D]");
    }
    std::vector<char> used(caches.size(), 0);
    for (int64_t r = 0; r < rows; ++r) {
        TORCH_CHECK(which[r] >= 0 && which[r] < (int64_t)caches.size(), "which out of range");
        const int64_t cap = caches[which[r]].size(4);
        TORCH_CHECK(0 <= lo[r] && lo[r] < hi[r] && hi[r] <= cap, "need 0 <= lo < hi <= capacity");
        if (writes) {  // rows writing their keys must not read each other's caches
            TORCH_CHECK(!used[which[r]], "rows that write keys need caches of their own");
            used[which[r]] = 1;
        }
    }
    const at::Tensor qc = (q * scale).contiguous();  // as torch's path scales q first
    const at::Tensor kvc = writes ? new_kv.contiguous() : new_kv;
    at::Tensor out = at::empty({rows, heads, head_dim}, q.options());
    const int64_t group = heads / kv_heads;
    int64_t work = 0;  // multiply-adds, to size the tasks
    for (int64_t r = 0; r < rows; ++r) work += (hi[r] - lo[r]) * heads * head_dim * 2;
    const int64_t tasks = rows * kv_heads;
    const int64_t grain = std::max<int64_t>(1, tasks * 65536 / std::max<int64_t>(1, work));
    const float* qp = qc.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;
        for (int64_t t = begin; t < end; ++t) {
            const int64_t r = t / kv_heads, g = t % kv_heads;
            const at::Tensor& c = caches[which[r]];
            float* base = c.data_ptr<float>() + layer * c.stride(0) + g * c.stride(3);
            float* keys = base;
            float* values = base + c.stride(1);
            if (writes) {
                const float* fresh = kvc.data_ptr<float>() + (r * kv_heads + g) * head_dim;
                std::copy(fresh, fresh + head_dim, keys + (hi[r] - 1) * head_dim);
                const float* fresh_v = fresh + rows * kv_heads * head_dim;
                std::copy(fresh_v, fresh_v + head_dim, values + (hi[r] - 1) * head_dim);
            }
            scores.resize((hi[r] - lo[r] + kLanes - 1) / kLanes * kLanes);
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
                const int64_t at = (r * heads + h) * head_dim;
                fn(qp + at, keys, values, head_dim, lo[r], hi[r], scores.data(), op + at);
            }
        }
    });
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(swarmd, m) {
    m.def(
        "attend(Tensor q, Tensor new_kv, Tensor[] caches, int layer, int[] which, int[] lo, "
        "int[] hi, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(swarmd, CPU, m) { m.impl("attend", attend); }
