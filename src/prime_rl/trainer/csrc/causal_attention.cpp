// Causal attention of packed samples on CPU, float32: every sample attends causally to its own keys only.
//
// Sample s holds queries [cu_q[s], cu_q[s+1]) and keys [cu_k[s], cu_k[s+1]), causal from the bottom right: with
// n queries and m >= n keys, query r sees keys 0 .. m - n + r (m == n: plain causal). m > n is a sample whose
// first m - n keys are a shared prefix's (trainer/prefix.py gathers them in front of its own).
//
// Work is split into query blocks of `block` rows; a block reads only the keys at or before its last row,
// so a sample costs its causal triangle (plus half a block on the diagonal), not its full square. The query
// heads that share a key/value head are stacked into one matrix, so each GEMM is `group` times taller.
// Scores of one block live in a per-thread buffer; the GEMMs are single-threaded BLAS calls (nested in
// ATen's parallel region), and threads take work items largest first from a shared counter.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numeric>
#include <vector>

extern "C" void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
                       const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace {

// Row-major C[m x n] = alpha * op(A)[m x k] * op(B)[k x n] + beta * C, through column-major BLAS (C^T = B^T A^T).
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const char tA = ta ? 'T' : 'N', tB = tb ? 'T' : 'N';
  const int M = m, N = n, K = k, LDA = lda, LDB = ldb, LDC = ldc;
  sgemm_(&tB, &tA, &N, &M, &K, &alpha, b, &LDB, a, &LDA, &beta, c, &LDC);
}

// Runs work(i) for every i, largest cost first, on ATen's threads.
template <typename F>
void run_items(std::vector<int64_t> cost, F work) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<int64_t> next{0};
  const int64_t n = order.size();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < n; i = next++) work(order[i]);
  });
}

struct Layout {  // a [1, heads, L, D] tensor: element (h, t, d) at h * head + t * token + d
  float* data;
  int64_t head, token;
  explicit Layout(const torch::Tensor& t) : data(t.data_ptr<float>()), head(t.stride(1)), token(t.stride(2)) {}
  float* at(int64_t h, int64_t t) const { return data + h * head + t * token; }
};

// A [1, heads, L, dim] float32 tensor whose last dimension is contiguous (copied only if it is not).
torch::Tensor checked(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 4 && t.size(0) == 1 && t.scalar_type() == torch::kFloat, name,
              " must be float32 [1, heads, L, dim]");
  return t.stride(3) == 1 ? t : t.contiguous();
}

// Rows [t, t + rows) of heads h0 .. h0 + group of `src`, stacked head by head into dst [group * rows, D].
void gather(const Layout& src, int64_t h0, int64_t group, int64_t t, int64_t rows, int64_t D, float* dst) {
  for (int64_t j = 0; j < group; ++j)
    for (int64_t r = 0; r < rows; ++r) std::copy_n(src.at(h0 + j, t + r), D, dst + (j * rows + r) * D);
}

// The inverse of `gather`.
void scatter(const float* src, const Layout& dst, int64_t h0, int64_t group, int64_t t, int64_t rows, int64_t D) {
  for (int64_t j = 0; j < group; ++j)
    for (int64_t r = 0; r < rows; ++r) std::copy_n(src + (j * rows + r) * D, D, dst.at(h0 + j, t + r));
}

// Query rows per block for a sample of n tokens: `block`, fewer where a block's scores
// [group * rows, n] would pass 8 MiB (long samples with many grouped heads), so buffers stay small.
int64_t rows_per_block(int64_t block, int64_t group, int64_t n) {
  constexpr int64_t budget = int64_t(1) << 21;  // floats
  return std::clamp(budget / std::max<int64_t>(group * n, 1), int64_t(1), block);
}

// Query heads per key/value head (checked, with the block size).
int64_t group_size(const torch::Tensor& q, const torch::Tensor& k, int64_t block) {
  const int64_t H = q.size(1), KV = k.size(1);
  TORCH_CHECK(KV > 0 && H % KV == 0, "query heads (", H, ") must be a multiple of key/value heads (", KV, ")");
  TORCH_CHECK(block > 0, "block must be positive, got ", block);
  return H / KV;
}

struct Bounds {  // boundaries of one side (queries or keys), checked against that side's length
  torch::Tensor cu;
  const int64_t* starts;
  int64_t count;
  Bounds(const torch::Tensor& cu_seqlens, int64_t L, const char* name) : cu(cu_seqlens.to(torch::kLong).contiguous()) {
    starts = cu.data_ptr<int64_t>(), count = cu.numel() - 1;
    TORCH_CHECK(count >= 0 && starts[0] == 0 && starts[count] == L, name, " must run from 0 to its length ", L);
    for (int64_t s = 0; s < count; ++s) TORCH_CHECK(starts[s] <= starts[s + 1], name, " must not decrease");
  }
  int64_t start(int64_t s) const { return starts[s]; }
  int64_t length(int64_t s) const { return starts[s + 1] - starts[s]; }
};

struct Samples {  // queries and keys of each sample; a sample has at least as many keys as queries
  Bounds q, k;
  int64_t count;
  Samples(const torch::Tensor& cu_q, const torch::Tensor& cu_k, int64_t Lq, int64_t Lk)
      : q(cu_q, Lq, "cu_seqlens_q"), k(cu_k, Lk, "cu_seqlens_k"), count(q.count) {
    TORCH_CHECK(k.count == count, "cu_seqlens_q and cu_seqlens_k must hold as many samples");
    for (int64_t s = 0; s < count; ++s)
      TORCH_CHECK(k.length(s) >= q.length(s), "sample ", s, " has fewer keys than queries");
  }
  int64_t offset(int64_t s) const { return k.length(s) - q.length(s); }  // the prefix's keys
};

}  // namespace

// q [1, H, L, D], k/v [1, KV, Lk, D] -> out [1, L, H, D], logsumexp [1, H, L].
std::vector<torch::Tensor> forward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cu_q,
                                   torch::Tensor cu_k, double scale, int64_t block) {
  q = checked(q, "q"), k = checked(k, "k"), v = checked(v, "v");
  const int64_t H = q.size(1), KV = k.size(1), L = q.size(2), D = q.size(3), group = group_size(q, k, block);
  const Samples samples(cu_q, cu_k, L, k.size(2));
  auto out = torch::empty({1, L, H, D}, q.options());
  auto lse = torch::empty({1, H, L}, q.options());
  const Layout Q(q), K(k), V(v), O(out.transpose(1, 2));
  float* LSE = lse.data_ptr<float>();

  struct Item { int64_t start, kstart, offset, kv, q0, q1; };
  std::vector<Item> items;
  std::vector<int64_t> cost;
  for (int64_t s = 0; s < samples.count; ++s) {
    const int64_t n = samples.q.length(s), off = samples.offset(s), rows = rows_per_block(block, group, n + off);
    for (int64_t kv = 0; kv < KV; ++kv)
      for (int64_t q0 = 0; q0 < n; q0 += rows) {
        const int64_t q1 = std::min(q0 + rows, n);
        items.push_back({samples.q.start(s), samples.k.start(s), off, kv, q0, q1});
        cost.push_back((q1 - q0) * (off + q1));
      }
  }
  run_items(cost, [&](int64_t i) {
    const Item& it = items[i];
    const int64_t rows = it.q1 - it.q0, keys = it.offset + it.q1, M = group * rows, h0 = it.kv * group,
                  t0 = it.start + it.q0;
    thread_local std::vector<float> buffer;
    buffer.resize(M * keys + 2 * M * D);
    float *S = buffer.data(), *Qg = S + M * keys, *Og = Qg + M * D;
    gather(Q, h0, group, t0, rows, D, Qg);
    gemm(false, true, M, keys, D, scale, Qg, D, K.at(it.kv, it.kstart), K.token, 0.f, S, keys);
    for (int64_t i = 0; i < M; ++i) {
      float* row = S + i * keys;
      const int64_t r = i % rows, valid = it.offset + it.q0 + r + 1;
      float mx = row[0];
      for (int64_t j = 1; j < valid; ++j) mx = std::max(mx, row[j]);
      float sum = 0.f;
      for (int64_t j = 0; j < valid; ++j) sum += (row[j] = std::exp(row[j] - mx));
      const float inv = 1.f / sum;
      for (int64_t j = 0; j < valid; ++j) row[j] *= inv;
      std::fill(row + valid, row + keys, 0.f);
      LSE[(h0 + i / rows) * L + t0 + r] = mx + std::log(sum);
    }
    gemm(false, false, M, D, keys, 1.f, S, keys, V.at(it.kv, it.kstart), V.token, 0.f, Og, D);
    scatter(Og, O, h0, group, t0, rows, D);
  });
  return {out, lse};
}

// Gradients of `forward` for q, k, v, given grad_out [1, L, H, D] and the forward's out and logsumexp.
std::vector<torch::Tensor> backward(torch::Tensor grad_out, torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    torch::Tensor out, torch::Tensor lse, torch::Tensor cu_q, torch::Tensor cu_k,
                                    double scale, int64_t block) {
  q = checked(q, "q"), k = checked(k, "k"), v = checked(v, "v");
  grad_out = grad_out.contiguous(), out = out.contiguous(), lse = lse.contiguous();
  const int64_t H = q.size(1), KV = k.size(1), L = q.size(2), D = q.size(3), group = group_size(q, k, block);
  const Samples samples(cu_q, cu_k, L, k.size(2));
  auto dq = torch::empty_like(q, at::MemoryFormat::Contiguous), dk = torch::zeros_like(k, at::MemoryFormat::Contiguous),
       dv = torch::zeros_like(v, at::MemoryFormat::Contiguous);
  const Layout Q(q), K(k), V(v), dQ(dq), dK(dk), dV(dv), dO(grad_out.transpose(1, 2)), O(out.transpose(1, 2));
  const float* LSE = lse.data_ptr<float>();

  // One item = one sample and one kv head: it alone accumulates into that head's dk/dv rows.
  std::vector<int64_t> cost;
  for (int64_t s = 0; s < samples.count; ++s)
    for (int64_t kv = 0; kv < KV; ++kv) cost.push_back(samples.q.length(s) * samples.k.length(s));
  run_items(cost, [&](int64_t i) {
    const int64_t s = i / KV, kv = i % KV, start = samples.q.start(s), n = samples.q.length(s), h0 = kv * group;
    const int64_t kstart = samples.k.start(s), off = samples.offset(s), m = samples.k.length(s);
    const int64_t step = rows_per_block(block, group, m), most = group * std::min(step, n);
    thread_local std::vector<float> buffer;
    buffer.resize(2 * most * m + 3 * most * D);
    float *P = buffer.data(), *dS = P + most * m, *Qg = dS + most * m, *dOg = Qg + most * D, *dQg = dOg + most * D;
    const float *k0 = K.at(kv, kstart), *v0 = V.at(kv, kstart);
    for (int64_t q0 = 0; q0 < n; q0 += step) {
      const int64_t rows = std::min(step, n - q0), keys = off + q0 + rows, M = group * rows, t0 = start + q0;
      gather(Q, h0, group, t0, rows, D, Qg);
      gather(dO, h0, group, t0, rows, D, dOg);
      gemm(false, true, M, keys, D, scale, Qg, D, k0, K.token, 0.f, P, keys);
      gemm(false, true, M, keys, D, 1.f, dOg, D, v0, V.token, 0.f, dS, keys);
      for (int64_t i = 0; i < M; ++i) {
        const int64_t h = h0 + i / rows, r = i % rows, valid = off + q0 + r + 1;
        const float *o = O.at(h, t0 + r), *g = dOg + i * D;
        float delta = 0.f;
        for (int64_t d = 0; d < D; ++d) delta += o[d] * g[d];
        const float m = LSE[h * L + t0 + r];
        float *p = P + i * keys, *ds = dS + i * keys;
        for (int64_t j = 0; j < valid; ++j) {
          p[j] = std::exp(p[j] - m);
          ds[j] = p[j] * (ds[j] - delta) * scale;
        }
        std::fill(p + valid, p + keys, 0.f);
        std::fill(ds + valid, ds + keys, 0.f);
      }
      gemm(false, false, M, D, keys, 1.f, dS, keys, k0, K.token, 0.f, dQg, D);
      scatter(dQg, dQ, h0, group, t0, rows, D);
      gemm(true, false, keys, D, M, 1.f, dS, keys, Qg, D, 1.f, dK.at(kv, kstart), dK.token);
      gemm(true, false, keys, D, M, 1.f, P, keys, dOg, D, 1.f, dV.at(kv, kstart), dV.token);
    }
  });
  return {dq, dk, dv};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward);
  m.def("backward", &backward);
}
