// megatron-mis native kernels: the MIS engine's two token passes for the host drop-ins (lists in,
// lists out) on a CPU, reading and writing the per-sample pieces directly (no joined copy).
//
// Built on first use by megatron_mis/core/native.py (torch.utils.cpp_extension); registered as
// torch ops in the namespace megatron_mis_native. The per-token arithmetic is the eager engine's
// (megatron_mis/core/engine.py, _token_stage and _outputs, mis_metrics: none): the same float32
// operations (each exact IEEE arithmetic, so vectorising them changes no value) and the same
// exponential (MKL's vmsExp in high-accuracy mode where torch is built with MKL, as torch.exp
// calls it; ATen's vectorised exp otherwise). Per-sequence sums are float64 sums of the float32
// values within fixed blocks, so they do not depend on the thread count.
// tests/unit/test_native.py compares the drop-in's outputs and gradients with the engine's, bit for
// bit.
//
// pass 1 (token_pass): per sequence float64 sums, in the columns the caller names
//   0 n_mask  1 n_valid  2 n_tok_kept  3 n_ratio_veto  4 n_prob_veto
//   5 sum train_v  6 sum rollout_v  7 sum w_kept  (and three differences of them)
// and a float32 scratch [T]: the token's kept weight (token-level IS) or 1 where the token is kept
// at token level, -1 where it is not.
// pass 2 (output_pass): from the scratch and the per-sequence decisions, the host's loss (pg_loss
// times the weight, exactly 0 where the token is not kept) and the kept masks [T] in the masks'
// (promoted) dtype; or, for the loss's backward, the weights [T] float32 and the keep mask [T] bool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if AT_MKL_ENABLED() && !defined(__APPLE__)
// torch.exp on a float32 CPU tensor is MKL's vmsExp in high-accuracy mode where torch is built with
// MKL (ATen/cpu/vml.h): the same call here gives the same values. The symbol is libtorch_cpu's.
extern "C" void vmsExp(const int n, const float* a, float* r, const long long mode);
extern "C" int MKL_Set_Num_Threads_Local(int nt);  // the C interface (mkl_service.h)
#define MEGATRON_MIS_MKL_EXP 1
#endif

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 256;    // tokens converted and exponentiated together
constexpr int64_t kItem = 8192;    // tokens per parallel work item (a piece may span several)
constexpr int64_t kSums = 8;

// ----------------------------------------------------------------------------- loads and stores
// One dtype dispatch per block, not per token: log-probs of any supported dtype into float32 (the
// engine converts them with .to(float32)), masks into 0/1 ("in the loss" iff value > 0), the
// returned masks in their dtype, the host's loss in pg_loss's dtype.
#define MIS_DISPATCH_LOG_PROB(type, ...) AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, type, "megatron_mis_native", __VA_ARGS__)
#define MIS_DISPATCH_MASK(type, ...) AT_DISPATCH_ALL_TYPES_AND3(at::kBool, at::kHalf, at::kBFloat16, type, "megatron_mis_native", __VA_ARGS__)

// float32 pieces are read in place; other dtypes are converted into `out`
const float* load_float(const at::Tensor& t, int64_t start, int64_t k, float* out) {
  if (t.scalar_type() == at::kFloat) return t.const_data_ptr<float>() + start;
  MIS_DISPATCH_LOG_PROB(t.scalar_type(), [&] {
    const scalar_t* p = t.const_data_ptr<scalar_t>() + start;
    for (int64_t i = 0; i < k; ++i) out[i] = static_cast<float>(p[i]);
  });
  return out;
}

// W lanes from p, or the c < W left at a block's end (the rest of the vector zero)
inline Vec load_lanes(const float* p, int64_t c) { return c >= Vec::size() ? Vec::loadu(p) : Vec::loadu(p, c); }

void load_mask(const at::Tensor& t, int64_t start, int64_t k, float* out) {
  MIS_DISPATCH_MASK(t.scalar_type(), [&] {
    const scalar_t* p = t.const_data_ptr<scalar_t>() + start;
    // branch-free (a mask is mostly ones; a mispredicted branch per zero costs more than the rest)
    if constexpr (std::is_integral_v<scalar_t>) {
      for (int64_t i = 0; i < k; ++i) out[i] = static_cast<float>(p[i] > 0);
    } else {
      for (int64_t i = 0; i < k; ++i) out[i] = static_cast<float>(p[i] > static_cast<scalar_t>(0));  // in T: NaN is out
    }
  });
}

void store_mask(at::Tensor& t, int64_t start, int64_t k, const uint8_t* keep) {
  MIS_DISPATCH_MASK(t.scalar_type(), [&] {
    scalar_t* p = t.mutable_data_ptr<scalar_t>() + start;
    for (int64_t i = 0; i < k; ++i) p[i] = static_cast<scalar_t>(keep[i] ? 1 : 0);
  });
}

// The host's loss: where(keep, pg * w.to(pg.dtype), 0) in pg's dtype, as torch computes it.
void store_loss(const at::Tensor& pg, at::Tensor& out, int64_t start, int64_t k, const float* w, const uint8_t* keep) {
  MIS_DISPATCH_LOG_PROB(pg.scalar_type(), [&] {
    using Acc = at::opmath_type<scalar_t>;
    const scalar_t* p = pg.const_data_ptr<scalar_t>() + start;
    scalar_t* o = out.mutable_data_ptr<scalar_t>() + start;
    for (int64_t i = 0; i < k; ++i)
      o[i] = keep[i] ? static_cast<scalar_t>(static_cast<Acc>(p[i]) * static_cast<Acc>(static_cast<scalar_t>(w[i])))
                     : static_cast<scalar_t>(0);
  });
}

// MKL runs each exp call on this thread alone while alive (the calls are already split over the
// threads; MKL's own threading inside them made the pass 2x slower on 2 cores).
struct SerialExp {
#ifdef MEGATRON_MIS_MKL_EXP
  int previous = MKL_Set_Num_Threads_Local(1);
  ~SerialExp() { MKL_Set_Num_Threads_Local(previous); }
#endif
};

// exp of k float32 values in place, as torch.exp computes them on this build
void exp_inplace(float* e, int64_t k) {
#ifdef MEGATRON_MIS_MKL_EXP
  constexpr long long kMode = 0x2 | 0x140000 | 0x100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE
  vmsExp(static_cast<int>(k), e, e, kMode);
#else
  int64_t i = 0;
  for (; i + Vec::size() <= k; i += Vec::size()) Vec::loadu(e + i).exp().store(e + i);
  if (i < k) Vec::loadu(e + i, k - i).exp().store(e + i, k - i);
#endif
}

double lane_sum(const Vec& x) {
  alignas(64) float lanes[Vec::size()];
  x.store(lanes);
  double total = 0.0;
  for (int64_t i = 0; i < Vec::size(); ++i) total += lanes[i];
  return total;
}

bool is_log_prob_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kBFloat16;
}

bool is_mask_dtype(at::ScalarType t) {
  return is_log_prob_dtype(t) || t == at::kBool || t == at::kByte || t == at::kChar || t == at::kShort ||
         t == at::kInt || t == at::kLong;
}

void check_pieces(const char* name, at::TensorList pieces, bool (*supported)(at::ScalarType)) {
  for (size_t i = 0; i < pieces.size(); ++i) {
    TORCH_CHECK_NOT_IMPLEMENTED(pieces[i].device().is_cpu(), "megatron_mis_native: ", name, "[", i, "] on ",
                                pieces[i].device(), " (the kernel runs on a CPU)");
    TORCH_CHECK_NOT_IMPLEMENTED(supported(pieces[i].scalar_type()), "megatron_mis_native: ", name, "[", i,
                                "] of dtype ", pieces[i].scalar_type());
  }
}

// ------------------------------------------------------------------------------ work items
struct Item { int64_t seq, begin, end; };  // tokens [begin, end) of piece `seq`

std::vector<Item> work_items(const std::vector<int64_t>& lengths) {
  std::vector<Item> items;
  for (int64_t n = 0; n < static_cast<int64_t>(lengths.size()); ++n)
    for (int64_t b = 0; b < lengths[n]; b += kItem) items.push_back({n, b, std::min(lengths[n], b + kItem)});
  return items;
}

// Boundaries [G+1] of G runs of consecutive items with about equal numbers of tokens (a few runs per
// thread): at::parallel_for splits its range into equal counts, and items of unequal length split
// that way left one thread waiting for the other.
std::vector<int64_t> balanced_groups(const std::vector<Item>& items) {
  const int64_t count = static_cast<int64_t>(items.size());
  int64_t total = 0;
  for (const auto& it : items) total += it.end - it.begin;
  const int64_t runs = std::max<int64_t>(1, std::min<int64_t>(count, 4 * at::get_num_threads()));
  std::vector<int64_t> bounds{0};
  int64_t seen = 0;
  for (int64_t i = 0; i < count; ++i) {
    seen += items[i].end - items[i].begin;
    const int64_t done = static_cast<int64_t>(bounds.size());  // runs closed so far + 1
    if (i + 1 < count && seen * runs >= total * done) bounds.push_back(i + 1);
  }
  bounds.push_back(count);
  return bounds;
}

std::vector<int64_t> piece_lengths(const std::vector<at::Tensor>& pieces) {
  std::vector<int64_t> out(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) out[i] = pieces[i].numel();
  return out;
}

std::vector<at::Tensor> contiguous(at::TensorList pieces) {
  std::vector<at::Tensor> out;
  out.reserve(pieces.size());
  for (const auto& p : pieces) out.push_back(p.contiguous());
  return out;
}

// ---------------------------------------------------------------------------------- pass 1
// options: bound, tis_mode (-1 no token IS, 0 truncate, 1 clip, 2 mask), tis_lo, tis_hi,
// token_rs (0/1), rs_lo, rs_hi, ratio_veto (0/1), log_ratio_veto, prob_veto (0: off, 1: rollout,
// 2: train), log_prob_veto, reject_nonfinite (0/1)
// columns: where the sums go in the [N, width] float64 result (the caller's column layout): the eight
// sums above, then sum log r (= sum train_v - sum rollout_v), n_nonfinite (= n_mask - n_valid) and
// n_tok_rejected (= n_mask - n_tok_kept); every other column is 0.
std::tuple<at::Tensor, at::Tensor> token_pass(
    at::TensorList train_in, at::TensorList rollout_in, at::TensorList mask_in, at::ArrayRef<double> options,
    at::IntArrayRef columns, int64_t width) {
  TORCH_CHECK(options.size() == 12, "megatron_mis_native.token_pass: 12 options expected, got ", options.size());
  TORCH_CHECK(columns.size() == kSums + 3, "megatron_mis_native.token_pass: ", kSums + 3, " columns expected");
  for (const auto c : columns) TORCH_CHECK(c >= 0 && c < width, "megatron_mis_native.token_pass: column ", c, " outside [0, ", width, ")");
  // what the kernel reads: CPU pieces of these dtypes; anything else is NotImplementedError, on which
  // the caller runs the torch engine (checked here, where it costs nanoseconds a piece)
  check_pieces("train_log_probs", train_in, is_log_prob_dtype);
  check_pieces("rollout_log_probs", rollout_in, is_log_prob_dtype);
  check_pieces("loss_masks", mask_in, is_mask_dtype);
  const auto rollout = contiguous(rollout_in);
  const auto masks = contiguous(mask_in);
  const bool has_train = !train_in.empty();
  const auto train = has_train ? contiguous(train_in) : rollout;
  const int64_t n = static_cast<int64_t>(rollout.size());
  TORCH_CHECK(static_cast<int64_t>(masks.size()) == n && static_cast<int64_t>(train.size()) == n,
              "megatron_mis_native.token_pass: one train, rollout and mask piece per sequence");
  const auto lengths = piece_lengths(rollout);
  std::vector<int64_t> offsets(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(train[i].numel() == lengths[i] && masks[i].numel() == lengths[i],
                "megatron_mis_native.token_pass: sequence ", i, ": pieces of different lengths");
    offsets[i + 1] = offsets[i] + lengths[i];
  }
  const float bound = static_cast<float>(options[0]);
  const int tis_mode = static_cast<int>(options[1]);
  const float tis_lo = static_cast<float>(options[2]), tis_hi = static_cast<float>(options[3]);
  const bool token_rs = options[4] != 0.0;
  const float rs_lo = static_cast<float>(options[5]), rs_hi = static_cast<float>(options[6]);
  const bool ratio_veto = options[7] != 0.0;
  // thresholds compare in float32, as torch compares a float32 tensor with a Python float
  const float log_ratio_veto = static_cast<float>(options[8]);
  const int prob_veto = static_cast<int>(options[9]);
  const float log_prob_veto = static_cast<float>(options[10]);
  const bool reject_nonfinite = options[11] != 0.0;
  const bool any_rejection = reject_nonfinite || tis_mode == 2 || token_rs;

  const auto items = work_items(lengths);
  std::vector<double> partial(items.size() * kSums, 0.0);
  auto scratch = at::empty({offsets[n]}, at::TensorOptions().dtype(at::kFloat));
  float* out = scratch.mutable_data_ptr<float>();

  const auto groups = balanced_groups(items);
  at::parallel_for(0, static_cast<int64_t>(groups.size()) - 1, 1, [&](int64_t first_group, int64_t last_group) {
    const SerialExp serial_exp;
    const int64_t first = groups[first_group], last = groups[last_group];
    alignas(64) float t[kBlock], r[kBlock], m[kBlock], v[kBlock], e[kBlock], tv[kBlock], rv[kBlock], wk[kBlock];
    const Vec zero(0.0f), one(1.0f), minus_one(-1.0f), lo_b(-bound), hi_b(bound);
    const Vec lrv(log_ratio_veto), lpv(log_prob_veto), tlo(tis_lo), thi(tis_hi), rlo(rs_lo), rhi(rs_hi);
    constexpr int64_t W = Vec::size();
    for (int64_t it = first; it < last; ++it) {
      const Item& item = items[it];
      double acc[kSums] = {0, 0, 0, 0, 0, 0, 0, 0};
      float* dst = out + offsets[item.seq];
      for (int64_t b = item.begin; b < item.end; b += kBlock) {
        const int64_t k = std::min(kBlock, item.end - b);
        const int64_t kv = (k + W - 1) / W * W;  // whole vectors; the padding is out of the loss
        const float* tp = load_float(train[item.seq], b, k, t);
        const float* rp = load_float(rollout[item.seq], b, k, r);
        load_mask(masks[item.seq], b, k, m);
        std::fill(m + k, m + kv, 0.0f);
        Vec c_mask(0.0f), c_valid(0.0f), c_rveto(0.0f), c_pveto(0.0f), c_kept(0.0f);
        // the clamped log-ratio, 0 where the token is not valid (masked_log_ratio)
        for (int64_t i = 0; i < kv; i += W) {
          const Vec vt = load_lanes(tp + i, k - i), vr = load_lanes(rp + i, k - i), vm = Vec::loadu(m + i);
          const Vec t_fin = (vt - vt) == zero, r_fin = (vr - vr) == zero;  // all-ones lanes where finite
          const Vec vf = Vec::blendv(zero, vm, t_fin & r_fin);
          const Vec tvi = Vec::blendv(zero, vt, t_fin) * vf, rvi = Vec::blendv(zero, vr, r_fin) * vf;
          const Vec diff = tvi - rvi;
          c_mask = c_mask + vm;
          c_valid = c_valid + vf;
          if (ratio_veto) {
            Vec veto = diff.lt(lrv);
            if (!(log_ratio_veto < 0.0f)) veto = veto * vf;
            c_rveto = c_rveto + veto;
          }
          if (prob_veto) c_pveto = c_pveto + (prob_veto == 2 ? vt : vr).lt(lpv) * vm;
          at::vec::minimum(at::vec::maximum(diff, lo_b), hi_b).store(e + i);
          vf.store(v + i);
          tvi.store(tv + i);
          rvi.store(rv + i);
        }
        exp_inplace(e, kv);
        for (int64_t i = 0; i < kv; i += W) {
          const Vec ratio = Vec::loadu(e + i), vm = Vec::loadu(m + i);
          Vec rejected = reject_nonfinite ? vm - Vec::loadu(v + i) : zero;
          Vec w = one;
          if (tis_mode == 0) {
            w = at::vec::minimum(ratio, thi);
          } else if (tis_mode == 1) {
            w = at::vec::minimum(at::vec::maximum(ratio, tlo), thi);
          } else if (tis_mode == 2) {
            const Vec outside = at::vec::maximum(ratio.lt(tlo) * vm, ratio.gt(thi) * vm);
            w = ratio * (one - outside);
            rejected = at::vec::maximum(rejected, outside);
          }
          if (token_rs) rejected = at::vec::maximum(rejected, at::vec::maximum(ratio.lt(rlo) * vm, ratio.gt(rhi) * vm));
          const Vec kept = any_rejection ? vm * (one - rejected) : vm;
          c_kept = c_kept + kept;
          const Vec w_kept = w * kept;
          w_kept.store(wk + i);
          const Vec slot = Vec::blendv(minus_one, tis_mode >= 0 ? w_kept : one, kept != zero);
          if (i + W <= k) slot.store(dst + b + i); else slot.store(dst + b + i, k - i);
        }
        // float64 sums of the float32 values (exact for log-probs of one sequence in practice;
        // in any case independent of the thread count)
        double s_t = 0.0, s_r = 0.0, s_w = 0.0;
#pragma omp simd reduction(+ : s_t, s_r, s_w)
        for (int64_t i = 0; i < k; ++i) {
          s_t += static_cast<double>(tv[i]);
          s_r += static_cast<double>(rv[i]);
          s_w += static_cast<double>(wk[i]);
        }
        // counts: at most kBlock / W per lane, exact in float32
        acc[0] += lane_sum(c_mask);
        acc[1] += lane_sum(c_valid);
        acc[2] += lane_sum(c_kept);
        acc[3] += lane_sum(c_rveto);
        acc[4] += lane_sum(c_pveto);
        acc[5] += s_t;
        acc[6] += s_r;
        if (tis_mode >= 0) acc[7] += s_w;
      }
      std::copy(acc, acc + kSums, partial.begin() + it * kSums);
    }
  });

  // per-sequence sums: the items of a sequence in token order (independent of the thread count)
  std::vector<double> seq(n * kSums, 0.0);
  for (size_t it = 0; it < items.size(); ++it)
    for (int64_t c = 0; c < kSums; ++c) seq[items[it].seq * kSums + c] += partial[it * kSums + c];
  auto sums = at::zeros({n, width}, at::TensorOptions().dtype(at::kDouble));
  double* s = sums.mutable_data_ptr<double>();
  for (int64_t i = 0; i < n; ++i) {
    const double* q = seq.data() + i * kSums;
    double* row = s + i * width;
    for (int64_t c = 0; c < kSums; ++c) row[columns[c]] = q[c];
    row[columns[kSums]] = q[5] - q[6];
    row[columns[kSums + 1]] = q[0] - q[1];
    row[columns[kSums + 2]] = q[0] - q[2];
  }
  return {sums, scratch};
}

// ---------------------------------------------------------------------------------- pass 2
// mode 0: token-level IS, weight = (kept weight) / norm; 1: sequence-level IS, weight = the
// sequence's weight; 2: no IS, weight = 1. alive [N] float32 0/1 (the sequence is not rejected);
// seq_weight [N] float32 (mode 1). A token is kept iff kept at token level and its sequence alive.
// with_loss: the loss [T] and the masks [T]; with_weights: the weights [T] float32 and the
// keep mask [T] bool (what the loss's backward reads). What is not asked for comes back empty.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> output_pass(
    at::IntArrayRef lengths_in, const at::Tensor& pg_in, const at::Tensor& scratch_in, const at::Tensor& alive_in,
    const at::Tensor& seq_weight_in, const at::Tensor& norm_in, int64_t mode, at::ScalarType mask_dtype,
    bool with_loss, bool with_weights) {
  const int64_t n = static_cast<int64_t>(lengths_in.size());
  const std::vector<int64_t> lengths = lengths_in.vec();
  std::vector<int64_t> offsets(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) offsets[i + 1] = offsets[i] + lengths[i];
  const int64_t total = offsets[n];
  const auto pg = pg_in.contiguous();
  const auto scratch = scratch_in.contiguous();
  const auto alive = alive_in.to(at::kFloat).contiguous();
  const auto seq_weight = seq_weight_in.to(at::kFloat).contiguous();
  TORCH_CHECK(norm_in.numel() == 1 && norm_in.device().is_cpu(), "megatron_mis_native.output_pass: a 0-dim CPU norm expected");
  const float norm = norm_in.to(at::kFloat).contiguous().const_data_ptr<float>()[0];  // the engine's norm.to(float32)
  TORCH_CHECK(scratch.numel() == total && (!with_loss || pg.numel() == total), "megatron_mis_native.output_pass: ",
              pg.numel(), " loss values and ", scratch.numel(), " scratch values for ", total, " tokens");
  TORCH_CHECK(alive.numel() == n && seq_weight.numel() == n, "megatron_mis_native.output_pass: [N] decisions expected");
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor loss = with_loss ? at::empty({total}, pg.options()) : at::empty({0}, pg.options());
  at::Tensor weights = at::empty({with_weights ? total : 0}, f32);
  at::Tensor keep_all = at::empty({with_weights ? total : 0}, at::TensorOptions().dtype(at::kBool));
  // the masks as one [T] tensor (split into per-sample views by the caller: a few hundred ns a view,
  // where a separate tensor per sample from here costs microseconds)
  at::Tensor out_masks = at::empty({with_loss ? total : 0}, at::TensorOptions().dtype(mask_dtype));
  const float* sc = scratch.const_data_ptr<float>();
  const float* al = alive.const_data_ptr<float>();
  const float* sw = seq_weight.const_data_ptr<float>();
  float* wout = with_weights ? weights.mutable_data_ptr<float>() : nullptr;
  uint8_t* kout = with_weights ? reinterpret_cast<uint8_t*>(keep_all.mutable_data_ptr<bool>()) : nullptr;
  const auto items = work_items(lengths);

  const auto groups = balanced_groups(items);
  at::parallel_for(0, static_cast<int64_t>(groups.size()) - 1, 1, [&](int64_t first_group, int64_t last_group) {
    const int64_t first = groups[first_group], last = groups[last_group];
    alignas(64) float w[kBlock], kf[kBlock];
    alignas(64) uint8_t keep[kBlock];
    constexpr int64_t W = Vec::size();
    const Vec zero(0.0f), norm_v(norm);
    for (int64_t it = first; it < last; ++it) {
      const Item& item = items[it];
      const Vec a(al[item.seq]), sweight(sw[item.seq]);
      for (int64_t b = item.begin; b < item.end; b += kBlock) {
        const int64_t k = std::min(kBlock, item.end - b);
        const float* s = sc + offsets[item.seq] + b;
        for (int64_t i = 0; i < k; i += W) {
          const int64_t c = std::min<int64_t>(W, k - i);
          const Vec slot = c == W ? Vec::loadu(s + i) : Vec::loadu(s + i, c);
          const Vec tok_kept = slot.ge(zero);  // 1 / 0
          const Vec keepf = tok_kept * a;
          Vec wv;
          if (mode == 0) wv = (at::vec::maximum(slot, zero) * keepf) / norm_v;  // the kept weight is >= 0
          else if (mode == 1) wv = sweight * tok_kept;
          else wv = keepf;
          wv.store(w + i, c);
          keepf.store(kf + i, c);
        }
        for (int64_t i = 0; i < k; ++i) keep[i] = kf[i] != 0.0f;
        if (with_loss) {
          store_loss(pg, loss, offsets[item.seq] + b, k, w, keep);
          store_mask(out_masks, offsets[item.seq] + b, k, keep);
        }
        if (with_weights) {
          std::copy(w, w + k, wout + offsets[item.seq] + b);
          std::copy(keep, keep + k, kout + offsets[item.seq] + b);
        }
      }
    }
  });
  return {loss, weights, keep_all, out_masks};
}

}  // namespace

TORCH_LIBRARY(megatron_mis_native, m) {
  m.def("token_pass(Tensor[] train, Tensor[] rollout, Tensor[] masks, float[] options, int[] columns, int width) -> (Tensor, Tensor)");
  m.def("output_pass(int[] lengths, Tensor pg_loss, Tensor scratch, Tensor alive, Tensor seq_weight, Tensor norm, int mode, ScalarType mask_dtype, bool with_loss, bool with_weights) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(megatron_mis_native, CPU, m) {
  m.impl("token_pass", &token_pass);
  m.impl("output_pass", &output_pass);
}
