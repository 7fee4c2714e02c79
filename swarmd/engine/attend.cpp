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
// padding and no masked keys computed. The query heads of a KV head, and of up to 4
// positions of a chunk, run as one tile that reads each block of keys and values once
// (a 2,048-token prefill +25-30 %); that shares memory traffic, never arithmetic.
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

// One query row and head of a tile: its scaled q, the keys it sees [lo, hi), its scores
// (room for hi - lo rounded up to 16, with 16 floats before them) and its output (D).
struct Pair {
    const float* q;
    int64_t lo, hi;
    float* scores;
    float* out;
};

constexpr int kMaxPairs = 64;  // query heads a tile: its rows x a KV head's query heads

// lanes j of a 16-key block from j0 whose key j0 + j lies in [lo, hi)
inline __mmask16 lanes_in(int64_t j0, int64_t lo, int64_t hi) {
    const int64_t a = std::max<int64_t>(0, lo - j0), b = std::min<int64_t>(kLanes, hi - j0);
    if (b <= a) return 0;
    return (__mmask16)(((1u << b) - 1) & ~((1u << a) - 1));
}

// The pairs of a tile (query heads of one KV head, from rows that read one cache) over
// keys/values rows (row j at keys + j * stride), C = D / 16 vectors a row. Each 16-key
// block of keys, then of values, is read from memory once for the whole tile (the pairs
// share it from L1) instead of once per query head. A pair's arithmetic is the same
// whatever the tile: its own scores key by key, its exp and sum aligned at its own lo, its
// values summed in two chains (even and odd keys from its lo) in key order. acc: room
// for P x 2 x C vectors.
template <int C>
void attend_tile(Pair* pairs, int P, const float* keys, const float* values, int64_t stride,
                 float* acc) {
    int64_t first = pairs[0].lo, last = pairs[0].hi;
    for (int p = 1; p < P; ++p) {
        first = std::min(first, pairs[p].lo);
        last = std::max(last, pairs[p].hi);
    }
    __m512 top[kMaxPairs];
    for (int p = 0; p < P; ++p) top[p] = _mm512_set1_ps(-INFINITY);
    for (int64_t j0 = first; j0 < last; j0 += kLanes) {
        for (int p = 0; p < P; ++p) {
            Pair& pair = pairs[p];
            const __mmask16 m = lanes_in(j0, pair.lo, pair.hi);
            if (!m) continue;
            __m512 qv[C];
            for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(pair.q + c * kLanes);
            __m512 dots[kLanes];
            for (int j = 0; j < kLanes; ++j) {
                if (!((m >> j) & 1)) {  // a key this pair does not see: never read
                    dots[j] = _mm512_setzero_ps();
                    continue;
                }
                const float* k = keys + (j0 + j) * stride;
                __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
                for (int c = 1; c < C; ++c)
                    a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + c * kLanes), a);
                dots[j] = a;
            }
            const __m512 s = sum16(dots);
            _mm512_mask_storeu_ps(pair.scores + (j0 - pair.lo), m, s);  // >= 15 floats before
            top[p] = _mm512_mask_max_ps(top[p], m, top[p], s);
        }
    }
    float inv[kMaxPairs];
    for (int p = 0; p < P; ++p) {
        Pair& pair = pairs[p];
        const int64_t n = pair.hi - pair.lo;
        const __m512 topv = _mm512_set1_ps(_mm512_reduce_max_ps(top[p]));
        __m512 total = _mm512_setzero_ps();
        for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
            const int64_t count = std::min<int64_t>(kLanes, n - j0);
            const __mmask16 m = count == kLanes ? 0xFFFF : (__mmask16)((1u << count) - 1);
            const __m512 w = _mm512_maskz_mov_ps(
                m, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, pair.scores + j0), topv)));
            _mm512_storeu_ps(pair.scores + j0, w);
            total = _mm512_add_ps(total, w);
        }
        inv[p] = 1.0f / _mm512_reduce_add_ps(total);
        for (int i = 0; i < 2 * C; ++i)
            _mm512_storeu_ps(acc + (p * 2 * C + i) * kLanes, _mm512_setzero_ps());
    }
    for (int64_t j0 = first; j0 < last; j0 += kLanes) {
        for (int p = 0; p < P; ++p) {
            const Pair& pair = pairs[p];
            const int64_t from = std::max(j0, pair.lo), to = std::min(j0 + kLanes, pair.hi);
            if (from >= to) continue;
            float* mine = acc + p * 2 * C * kLanes;
            __m512 even[C], odd[C];
            for (int c = 0; c < C; ++c) {
                even[c] = _mm512_loadu_ps(mine + c * kLanes);
                odd[c] = _mm512_loadu_ps(mine + (C + c) * kLanes);
            }
            for (int64_t j = from; j < to; ++j) {
                const float* v = values + j * stride;
                const __m512 w = _mm512_set1_ps(pair.scores[j - pair.lo]);
                if ((j - pair.lo) & 1) {
                    for (int c = 0; c < C; ++c)
                        odd[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + c * kLanes), odd[c]);
                } else {
                    for (int c = 0; c < C; ++c)
                        even[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + c * kLanes), even[c]);
                }
            }
            for (int c = 0; c < C; ++c) {
                _mm512_storeu_ps(mine + c * kLanes, even[c]);
                _mm512_storeu_ps(mine + (C + c) * kLanes, odd[c]);
            }
        }
    }
    for (int p = 0; p < P; ++p) {
        const float* mine = acc + p * 2 * C * kLanes;
        const __m512 scale = _mm512_set1_ps(inv[p]);
        for (int c = 0; c < C; ++c) {
            const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(mine + c * kLanes),
                                             _mm512_loadu_ps(mine + (C + c) * kLanes));
            _mm512_storeu_ps(pairs[p].out + c * kLanes, _mm512_mul_ps(sum, scale));
        }
    }
}

using TileFn = void (*)(Pair*, int, const float*, const float*, int64_t, float*);

template <size_t... I>
TileFn pick(int64_t vectors, std::index_sequence<I...>) {
    TileFn fn = nullptr;
    ((vectors == (int64_t)I + 1 ? (fn = attend_tile<I + 1>, 0) : 0), ...);
    return fn;
}

// Head dims 16, 32, ..., 256 (native.py's attend_fits).
TileFn tile_fn(int64_t head_dim) {
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
    const TileFn fn = tile_fn(head_dim);
    TORCH_CHECK(fn != nullptr, "head dim must be a multiple of 16 up to 256");
    TORCH_CHECK(!caches.empty(), "no caches");
    const int64_t kv_heads = caches[0].dim() == 6 ? caches[0].size(3) : 0;
    TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "heads must be a multiple of KV heads");
    TORCH_CHECK(heads / kv_heads <= kMaxPairs, "at most 64 query heads a KV head");
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
    // Tiles: up to 4 consecutive rows that read the same cache (a prompt chunk's
    // positions), so a block of keys is read once for all their query heads.
    const int64_t tile_rows = std::max<int64_t>(1, std::min<int64_t>(4, kMaxPairs / group));
    std::vector<int64_t> tiles;  // first row of each tile, then `rows`
    for (int64_t r = 0; r < rows; ++r) {
        if (tiles.empty() || which[r] != which[tiles.back()] || r - tiles.back() >= tile_rows)
            tiles.push_back(r);
    }
    tiles.push_back(rows);
    int64_t work = 0;  // multiply-adds, to size the tasks
    for (int64_t r = 0; r < rows; ++r) work += (hi[r] - lo[r]) * heads * head_dim * 2;
    const int64_t tasks = (int64_t)(tiles.size() - 1) * kv_heads;
    const int64_t grain = std::max<int64_t>(1, tasks * 65536 / std::max<int64_t>(1, work));
    const float* qp = qc.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t vectors = head_dim / kLanes;
    at::parallel_for(0, tasks, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch;
        std::vector<float> acc(kMaxPairs * 2 * vectors * kLanes);
        Pair pairs[kMaxPairs];
        for (int64_t t = begin; t < end; ++t) {
            const int64_t tile = t / kv_heads, g = t % kv_heads;
            const int64_t r0 = tiles[tile], r1 = tiles[tile + 1];
            const at::Tensor& c = caches[which[r0]];
            float* base = c.data_ptr<float>() + layer * c.stride(0) + g * c.stride(3);
            float* keys = base;
            float* values = base + c.stride(1);
            // a pair's scores: its keys rounded up to 16, with 16 floats before them
            auto scores_of = [&](int64_t r) {
                return (hi[r] - lo[r] + kLanes - 1) / kLanes * kLanes + kLanes;
            };
            size_t room = 0;
            for (int64_t r = r0; r < r1; ++r) {
                if (writes) {  // a decode row: its own cache (checked), its key and value
                    const float* fresh = kvc.data_ptr<float>() + (r * kv_heads + g) * head_dim;
                    std::copy(fresh, fresh + head_dim, keys + (hi[r] - 1) * head_dim);
                    const float* fresh_v = fresh + rows * kv_heads * head_dim;
                    std::copy(fresh_v, fresh_v + head_dim, values + (hi[r] - 1) * head_dim);
                }
                room += group * scores_of(r);
            }
            scratch.resize(room);
            int p = 0;
            float* free = scratch.data();
            for (int64_t r = r0; r < r1; ++r) {
                for (int64_t h = g * group; h < (g + 1) * group; ++h, ++p) {
                    const int64_t at = (r * heads + h) * head_dim;
                    pairs[p] = Pair{qp + at, lo[r], hi[r], free + kLanes, op + at};
                    free += scores_of(r);
                }
            }
            fn(pairs, p, keys, values, head_dim, acc.data());
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
