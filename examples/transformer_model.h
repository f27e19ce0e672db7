// The decoder-only transformer of example_transformer, shared with its test and
// bench_transformer: a character-level language model with token and position embeddings
// (`take`), pre-norm blocks (causal multi-head attention, a gelu MLP) run by `scan` over
// parameters stacked along a leading layer dimension, a final layer norm and an output
// projection; trained with clip_by_global_norm + AdamW under a warmup-cosine schedule.
//
//   transformer::Model m{config, Layout::kFsdp, mesh};
//   TreeJitted init = m.init();                     // key -> parameters, made on the devices
//   TreeJitted opt_init = m.optimizer_init(), step = m.train_step();
//   // step({params, state, batch}) -> {loss, params, state}; batch {"tokens", "targets"}
//   // with config.drops(): step({params, state, batch, {"key": uint32[2], "step": int32}})
//   // held-out loss: windows_loss(client, m, m.eval(), params, text, eval_windows(...))
//
// Layouts over a ('data', 'model') mesh:
//   dp       pure data parallelism on every device: the batch over ('data', 'model') (each of
//            the 8 devices of (4, 2) takes its own slice, P(('data', 'model'), None)), the
//            parameters replicated; gradients all-reduced over both axes.
//   tp       Megatron: q/k/v and the MLP's first weight split by columns (heads, hidden) over
//            'model', the attention output and the MLP's second weight by rows, so each block
//            joins its halves with one all-reduce per pass.
//   fsdp     the batch over 'data', with every parameter (and so its optimiser state) stored split over 'data'
//            along its first dimension that divides; each is constrained to its use layout
//            (replicated) where it is read, so the compiler all-gathers it there, and its
//            gradient goes back to the stored layout.
//   fsdp_tp  tp's use layouts, stored with 'data' on a remaining dimension.
#ifndef TESSERA_EXAMPLES_TRANSFORMER_MODEL_H_
#define TESSERA_EXAMPLES_TRANSFORMER_MODEL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "tessera/tessera.h"

namespace tessera::transformer {

struct Config {
  int64_t vocab = 256, d_model = 128, heads = 4, layers = 4, seq = 128, batch = 32;
  double lr = 3e-3, weight_decay = 0.01, clip = 1.0;
  int64_t warmup = 20, steps = 200;  // the schedule: warmup, then cosine decay to lr/10 at `steps`
  // Each block under checkpoint (jax.checkpoint_policies): "none" keeps every activation for
  // the backward pass; "dots" keeps the matmuls' results (dots_with_no_batch_dims_saveable:
  // the projections, not the attention scores) and recomputes the rest; "full" keeps only
  // the blocks' inputs.
  std::string remat = "none";
  // Dropout rate (flax nn.Dropout: keep with probability 1 - dropout, kept values scaled by
  // 1 / (1 - dropout)) on the embeddings and on each block's two residual branches (GPT-2's
  // embd_pdrop and resid_pdrop), in training steps only; 0 draws nothing.
  double dropout = 0;
  // Dropout rate on the attention probabilities (GPT-2's attn_pdrop; flax's
  // dot_product_attention_weights with dropout_rate), in training steps only; 0 draws nothing.
  double attention_dropout = 0;
  // Whether a training step draws masks (and so needs its dropout key).
  bool drops() const { return dropout > 0 || attention_dropout > 0; }
  int64_t hidden() const { return 4 * d_model; }
  int64_t head_dim() const { return d_model / heads; }
};

enum class Layout { kDp, kTp, kFsdp, kFsdpTp };

inline const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kDp:
      return "dp";
    case Layout::kTp:
      return "tp";
    case Layout::kFsdp:
      return "fsdp";
    case Layout::kFsdpTp:
      break;
  }
  return "fsdp_tp";
}

inline absl::Status check_remat(const std::string& s) {
  if (s == "none" || s == "dots" || s == "full") return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("--remat=", s, " is not one of none, dots, full"));
}

inline absl::StatusOr<Layout> parse_layout(const std::string& s) {
  for (Layout l : {Layout::kDp, Layout::kTp, Layout::kFsdp, Layout::kFsdpTp}) {
    if (s == layout_name(l)) return l;
  }
  return absl::InvalidArgumentError(absl::StrCat("--parallel=", s, " is not one of dp, tp, fsdp, fsdp_tp"));
}

// Every parameter: its name, global shape, use spec (the layout it is read in: one layer's row
// for the stacked "layers.*" leaves) and initial standard deviation (0: zeros; < 0: ones).
struct ParamInfo {
  Shape shape;
  std::vector<Axes> use;  // one entry per dimension of the row
  double stddev = 0;
};

inline std::map<std::string, ParamInfo> param_infos(const Config& c, Layout layout) {
  const bool tp = layout == Layout::kTp || layout == Layout::kFsdpTp;
  const Axes m = tp ? Axes{"model"} : Axes{};
  const int64_t L = c.layers, D = c.d_model, F = c.hidden(), V = c.vocab;
  const double w = 0.02, residual = 0.02 / std::sqrt(2.0 * static_cast<double>(L));  // GPT-2's
  std::map<std::string, ParamInfo> p;
  p["embed"] = {{V, D}, {{}, {}}, w};
  p["pos"] = {{c.seq, D}, {{}, {}}, w};
  p["ln_f.scale"] = {{D}, {{}}, -1};
  p["ln_f.bias"] = {{D}, {{}}, 0};
  p["head"] = {{D, V}, {{}, {}}, w};
  p["layers.ln1.scale"] = {{L, D}, {{}}, -1};
  p["layers.ln1.bias"] = {{L, D}, {{}}, 0};
  p["layers.ln2.scale"] = {{L, D}, {{}}, -1};
  p["layers.ln2.bias"] = {{L, D}, {{}}, 0};
  for (const char* n : {"layers.attn.wq", "layers.attn.wk", "layers.attn.wv"}) p[n] = {{L, D, D}, {{}, m}, w};
  p["layers.attn.wo"] = {{L, D, D}, {m, {}}, residual};
  p["layers.mlp.w1"] = {{L, D, F}, {{}, m}, w};
  p["layers.mlp.b1"] = {{L, F}, {m}, 0};
  p["layers.mlp.w2"] = {{L, F, D}, {m, {}}, residual};
  p["layers.mlp.b2"] = {{L, D}, {{}}, 0};
  return p;
}

inline bool stacked(const std::string& name) { return absl::StartsWith(name, "layers."); }

// The axes the batch is split over: every axis the layout does not use for tensor parallelism.
// Under dp and fsdp 'model' splits nothing else, so the batch goes over both axes, as a JAX user
// writes data parallelism on all the devices (P(('data', 'model'), None)); over 'data' alone each
// 'model' pair would compute the same examples (twice the one-device work on the mesh).
inline Axes data_parallel_axes(Layout layout) {
  return layout == Layout::kDp || layout == Layout::kFsdp ? Axes{"data", "model"} : Axes{"data"};
}

// The layout parameter `name` is stored in: its use spec (after the layer dimension of a
// stacked leaf), with the data-parallel axes on the first unsplit dimension they divide under
// fsdp layouts (ZeRO-3: each device of the data-parallel group keeps one block).
inline PartitionSpec storage_spec(const Config& c, Layout layout, const Mesh& mesh, const std::string& name) {
  const ParamInfo info = param_infos(c, layout).at(name);
  std::vector<Axes> dims = info.use;
  if (stacked(name)) dims.insert(dims.begin(), Axes{});
  if (layout == Layout::kFsdp || layout == Layout::kFsdpTp) {
    const Axes axes = data_parallel_axes(layout);
    int64_t n = 1;
    for (const std::string& a : axes) n *= mesh.axis_size(a);
    for (size_t d = stacked(name) ? 1 : 0; d < dims.size(); ++d) {
      if (dims[d].empty() && info.shape[d] % n == 0) {
        dims[d] = axes;
        break;
      }
    }
  }
  return PartitionSpec(dims);
}

// flax.linen.Dropout(rate)(x, deterministic=False) with its rng `key` (uint32[2]): each element
// kept with probability 1 - rate (random::bernoulli over x's shape, so under any sharding every
// device draws its own elements' bits and the mask is the unsharded one) and scaled by
// 1 / (1 - rate), the others 0 (flax/linen/stochastic.py: select(keep, x / keep_prob, 0)).
// rate 0 returns x and draws nothing; rate 1 returns zeros.
inline Value dropout(const Value& x, double rate, const Value& key) {
  if (rate <= 0) return x;
  if (rate >= 1) return full(x.shape(), 0.0, x.dtype());
  const Value zero = full({}, 0.0, x.dtype());
  const Value keep = random::bernoulli(key, 1.0 - rate, x.shape());
  return where(keep, x / (1.0 - rate), zero);
}

// The stream the training steps' dropout keys come from: fold_in(seed key, kDropoutStream),
// then fold_in(., step). init's keys are split(seed key, P)[i] = fold_in(seed key, i), one per
// parameter (indices 0..P-1, P = param_infos' size, 17), so the streams do not meet
// (DropoutStepKeysDifferFromEachOtherAndFromInits checks).
constexpr int64_t kDropoutStream = 0x64726f70;  // "drop"

// Causal multi-head attention of query, key and value (B, T, N, H), as
// nn::dot_product_attention(query, key, value, std::nullopt, /*is_causal=*/true) computes it,
// with dropout(·, rate, key) on the probabilities (B, N, T, T) before they weigh the values
// (flax.linen.dot_product_attention_weights with dropout_rate and deterministic=False; GPT-2's
// attn_pdrop). Written out here because nn::dot_product_attention (jax.nn's) has no dropout.
inline Value causal_attention_with_dropout(const Value& query, const Value& key, const Value& value, double rate,
                                           const Value& dropout_key) {
  const Shape qs = query.shape();
  const Value logits =
      dot_general(query, key, DotDims{{0, 2}, {0, 2}, {3}, {3}}) * (1.0 / std::sqrt(static_cast<double>(qs[3])));
  const Shape ts = {qs[1], qs[1]};
  const Value causal = broadcast_to(iota(DType::kI32, ts, 0) >= iota(DType::kI32, ts, 1), logits.shape());
  const Value masked = where(causal, logits, full({}, std::numeric_limits<float>::lowest(), logits.dtype()));
  const Value weights = dropout(nn::softmax(masked, -1), rate, dropout_key);
  return transpose(dot_general(weights, value, DotDims{{0, 1}, {0, 2}, {3}, {1}}), {0, 2, 1, 3});
}

class Model {
 public:
  Model(Config config, Layout layout, Mesh mesh) : c_(config), layout_(layout), mesh_(std::move(mesh)) {}
  const Config& config() const { return c_; }
  const Mesh& mesh() const { return mesh_; }

  ShardingRule param_rule() const {
    Config c = c_;
    Layout layout = layout_;
    Mesh mesh = mesh_;
    return ShardingRule([c, layout, mesh](absl::string_view name) -> std::optional<PartitionSpec> {
      const std::map<std::string, ParamInfo> infos = param_infos(c, layout);
      if (infos.count(std::string(name)) == 0) return std::nullopt;
      return storage_spec(c, layout, mesh, std::string(name));
    });
  }
  // Tokens and targets (batch, seq): the batch over the layout's data-parallel axes.
  static PartitionSpec batch_spec(Layout layout) { return P(data_parallel_axes(layout), None); }
  PartitionSpec batch_spec() const { return batch_spec(layout_); }
  NamedSharding batch_sharding() const { return NamedSharding(mesh_, batch_spec()); }

  // {key uint32[2]} -> {parameters}: leaf i (in name order) drawn from split(key, n)[i], as
  // normal * stddev (or zeros, ones), each generated where its storage layout puts it.
  TreeJitted init() const {
    const Model self = *this;
    return jit(
        [self](const std::vector<Tree<Value>>& in) {
          const std::map<std::string, ParamInfo> infos = param_infos(self.c_, self.layout_);
          const Value keys = random::split(*in[0].find(""), static_cast<int64_t>(infos.size()));
          Tree<Value> params;
          int64_t i = 0;
          for (const auto& [name, info] : infos) {
            const Value v = info.stddev > 0   ? random::normal(random::key_at(keys, i), info.shape) * info.stddev
                            : info.stddev < 0 ? full(info.shape, 1.0)
                                              : full(info.shape, 0.0);
            params.set(name, v);
            ++i;
          }
          return std::vector<Tree<Value>>{params};
        },
        {.out_shardings = {param_rule()}});
  }

  optim::GradientTransformation optimizer() const {
    return optim::chain({optim::clip_by_global_norm(c_.clip),
                         optim::adamw(optim::warmup_cosine_decay_schedule(0.0, c_.lr, c_.warmup, c_.steps, c_.lr / 10),
                                      0.9, 0.99, 1e-8, c_.weight_decay)});
  }
  TreeJitted optimizer_init() const {
    const optim::GradientTransformation opt = optimizer();
    return jit([opt](const std::vector<Tree<Value>>& in) { return std::vector<Tree<Value>>{opt.init(in[0])}; });
  }

  // Logits (batch, seq, vocab) of tokens (batch, seq) int32. With a dropout `key` (uint32[2])
  // and a positive rate, dropout on the embeddings (key fold_in(key, layers)) and on layer l's
  // attention and MLP branches (keys fold_in(k_l, 0) and fold_in(k_l, 1), k_l = split(key,
  // layers)[l], read by the scan as one more xs), and at a positive attention_dropout on layer
  // l's attention probabilities (key fold_in(k_l, 2)); without a key, none (evaluation, sampling).
  Value logits(const Tree<Value>& params, const Value& tokens, const std::optional<Value>& key = std::nullopt) const {
    const bool drop = key.has_value() && c_.drops();
    const int64_t B = tokens.shape()[0], T = tokens.shape()[1];
    auto use = [&](const std::string& name, const Value& v) {
      if (layout_ == Layout::kDp || layout_ == Layout::kTp) return v;
      return with_sharding_constraint(v, NamedSharding(mesh_, PartitionSpec(param_infos(c_, layout_).at(name).use)));
    };
    auto get = [&](const std::string& name) { return use(name, *params.find(name)); };
    // Tokens through take (the cookbook's embedding.at[tokens].get); positions by adding the
    // table, as JAX's training cookbook does (docs/the-training-cookbook.py, model_apply:
    // `out += params.pos_embed`, its sequences always seq_length long). A shorter sequence
    // (sampling) adds the table's first T rows: a static slice, equal to take at iota(T).
    Value pos = get("pos");
    if (T < c_.seq) pos = slice(pos, {0, 0}, {T, c_.d_model});
    Value x = take(get("embed"), tokens, 0) + pos;
    if (drop) x = dropout(x, c_.dropout, random::fold_in(*key, c_.layers));
    // The stacked leaves, in name order, are the scan's xs; the body sees one layer's row.
    std::vector<std::string> names;
    std::vector<Value> stacks;
    for (const auto& [name, v] : params) {
      if (stacked(name)) {
        names.push_back(name);
        stacks.push_back(v);
      }
    }
    if (drop) stacks.push_back(random::split(*key, c_.layers));  // the rows' keys, uint32[layers, 2]
    const Config c = c_;
    const TracedFunction block = [&](const std::vector<Value>& in) {
      std::map<std::string, Value> l;
      for (size_t i = 0; i < names.size(); ++i) l[names[i].substr(7)] = use(names[i], in[1 + i]);
      const Value h = in[0];
      const Value a = nn::layer_norm(h, l["ln1.scale"], l["ln1.bias"]);
      auto heads = [&](const Value& w) { return reshape(matmul(a, w), {B, T, c.heads, c.head_dim()}); };
      const Value att =
          drop && c.attention_dropout > 0
              ? causal_attention_with_dropout(heads(l["attn.wq"]), heads(l["attn.wk"]), heads(l["attn.wv"]),
                                              c.attention_dropout, random::fold_in(in.back(), 2))
              : nn::dot_product_attention(heads(l["attn.wq"]), heads(l["attn.wk"]), heads(l["attn.wv"]), std::nullopt,
                                          /*is_causal=*/true);
      auto branch = [&](const Value& v, int64_t site) {
        return drop ? dropout(v, c.dropout, random::fold_in(in.back(), site)) : v;
      };
      const Value h1 = h + branch(matmul(reshape(att, {B, T, c.d_model}), l["attn.wo"]), 0);
      const Value m = nn::layer_norm(h1, l["ln2.scale"], l["ln2.bias"]);
      const Value h2 =
          h1 + branch(matmul(nn::gelu(matmul(m, l["mlp.w1"]) + l["mlp.b1"]), l["mlp.w2"]) + l["mlp.b2"], 1);
      return std::vector<Value>{h2};
    };
    const TracedFunction layer = c.remat == "full" ? checkpoint(block)
                                 : c.remat == "dots"
                                     ? checkpoint(block, checkpoint_policies::dots_with_no_batch_dims_saveable)
                                     : block;
    ScanResult r = scan(
        [&](const std::vector<Value>& carry, const std::vector<Value>& rows) {
          std::vector<Value> in = {carry[0]};
          in.insert(in.end(), rows.begin(), rows.end());
          return ScanStep{layer(in), {}};
        },
        {x}, stacks);
    x = nn::layer_norm(r.carry[0], get("ln_f.scale"), get("ln_f.bias"));
    return matmul(x, get("head"));
  }

  // Mean cross-entropy (nats per token) of the next-token predictions (with dropout under `key`).
  Value loss(const Tree<Value>& params, const Value& tokens, const Value& targets,
             const std::optional<Value>& key = std::nullopt) const {
    return mean(nn::cross_entropy(logits(params, tokens, key), targets));
  }

  // The key of a training step's dropout: fold_in(fold_in(seed key, kDropoutStream), step), the
  // same on every layout (made from replicated scalars, not from any device's position).
  static Value step_dropout_key(const Value& seed_key, const Value& step) {
    return random::fold_in(random::fold_in(seed_key, kDropoutStream), step);
  }

  // {params, opt_state, {"tokens", "targets"}[, {"key": uint32[2], "step": int32 scalar}]} ->
  // {loss, params, opt_state}; the parameters and the state are donated. The fourth tree (both
  // replicated) gives the step's dropout key (step_dropout_key); at dropout 0 the step draws
  // nothing. The call fails (INVALID_ARGUMENT) at Config::drops() without the fourth tree, as flax's
  // Dropout without a 'dropout' rng and stax's Dropout without an rng raise, and for a fourth
  // tree without "key" or "step".
  TreeJitted train_step() const {
    return jit(train_step_function(),
               {.out_shardings = {std::nullopt, param_rule(), std::nullopt}, .donate_argnums = {0, 1}});
  }
  // What train_step traces (without its out_shardings): for compiling the step without a
  // cluster (tests/coordinator/transformer_plan_test.cc).
  TreeFunction train_step_function() const {
    const Model self = *this;
    const optim::GradientTransformation opt = optimizer();
    return [self, opt](const std::vector<Tree<Value>>& in) {
      std::optional<Value> key;
      if (self.c_.drops()) {
        if (in.size() < 4) {
          fail_trace(absl::InvalidArgumentError(absl::StrCat("train_step: dropout ", self.c_.dropout,
                                                             " and attention dropout ", self.c_.attention_dropout,
                                                             " need the fourth tree {key, step}")));
          return std::vector<Tree<Value>>{};
        }
        for (const char* leaf : {"key", "step"}) {
          if (in[3].find(leaf) == nullptr) {
            fail_trace(absl::InvalidArgumentError(
                absl::StrCat("train_step: the fourth tree has no \"", leaf, "\" (it must be {key, step})")));
            return std::vector<Tree<Value>>{};
          }
        }
        key = step_dropout_key(*in[3].find("key"), *in[3].find("step"));
      }
      TreeFunction loss = [&self, &key](const std::vector<Tree<Value>>& a) {
        return std::vector<Tree<Value>>{self.loss(a[0], *a[1].find("tokens"), *a[1].find("targets"), key)};
      };
      std::vector<Tree<Value>> vg = value_and_grad(loss, {0})({in[0], in[2]});
      auto [updates, state] = opt.update(vg[1], in[1], in[0]);
      return std::vector<Tree<Value>>{vg[0], optim::apply_updates(in[0], updates), state};
    };
  }

  // {params, {"tokens", "targets"}} -> {the loss of each prediction (batch, seq)}.
  TreeJitted eval() const {
    const Model self = *this;
    return jit([self](const std::vector<Tree<Value>>& in) {
      return std::vector<Tree<Value>>{
          nn::cross_entropy(self.logits(in[0], *in[1].find("tokens")), *in[1].find("targets"))};
    });
  }

  // {params, tokens} -> {the greedy next token after each position (batch, seq) int32}.
  TreeJitted predict() const {
    const Model self = *this;
    return jit([self](const std::vector<Tree<Value>>& in) {
      return std::vector<Tree<Value>>{argmax(self.logits(in[0], *in[1].find("")), 2)};
    });
  }

 private:
  Config c_;
  Layout layout_;
  Mesh mesh_;
};

// ---- The held-out evaluation ------------------------------------------------------------------
//
// A fixed-context model scores a text by sliding windows of `seq` characters over it every
// `stride` characters and counting, of each window's predictions, only those no earlier
// window made (the strided perplexity of HF transformers' docs, "Perplexity of fixed-length
// models"), so every character is counted exactly once and, after the first window, with at
// least seq - stride + 1 characters of context. stride == seq is consecutive windows.

// One window: tokens text[start, start + seq), targets text[start + 1, start + seq + 1); its
// predictions at positions first_counted..seq-1 are counted.
struct EvalWindow {
  int64_t start = 0;
  int64_t first_counted = 0;
  bool operator==(const EvalWindow& o) const { return start == o.start && first_counted == o.first_counted; }
};

// The windows that count the prediction of each character text[first_target..length-1] of a
// text of `length` characters exactly once: starts first_target - 1 - (seq - stride) (at least
// 0), then every `stride`, the last moved back to end at the text's end (the ragged tail).
// REQUIRES: 1 <= stride <= seq < length, 1 <= first_target < length.
inline std::vector<EvalWindow> eval_windows(int64_t length, int64_t seq, int64_t stride, int64_t first_target = 1) {
  std::vector<EvalWindow> out;
  int64_t last = first_target - 1;  // the last target counted so far
  for (int64_t start = std::max<int64_t>(0, first_target - 1 - (seq - stride)); last < length - 1; start += stride) {
    start = std::min(start, length - 1 - seq);
    out.push_back({start, last - start});
    last = start + seq;
  }
  return out;
}

// Tokens (rows, seq) and targets (the next characters) of the windows of `text` at `starts`.
inline Tree<HostArray> window_batch(const std::string& text, const std::vector<int64_t>& starts, int64_t seq) {
  const int64_t n = static_cast<int64_t>(starts.size());
  HostArray tokens(DType::kI32, {n, seq}), targets(DType::kI32, {n, seq});
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t t = 0; t < seq; ++t) {
      tokens.mutable_values<int32_t>()[r * seq + t] = static_cast<unsigned char>(text[starts[r] + t]);
      targets.mutable_values<int32_t>()[r * seq + t] = static_cast<unsigned char>(text[starts[r] + t + 1]);
    }
  }
  Tree<HostArray> batch;
  batch.set("tokens", std::move(tokens));
  batch.set("targets", std::move(targets));
  return batch;
}

// The mean loss (nats per character) of model.eval() (`eval`) with `params` over the
// predictions of `windows` of `text`, config().batch windows per call (the last call padded
// with repeats of its first window, not counted). Errors: those of device_put and the call.
inline absl::StatusOr<double> windows_loss(const Client& client, const Model& model, const TreeJitted& eval,
                                           const Tree<Array>& params, const std::string& text,
                                           const std::vector<EvalWindow>& windows) {
  const int64_t seq = model.config().seq, batch_size = model.config().batch;
  double total = 0;
  int64_t counted = 0;
  for (size_t b = 0; b < windows.size(); b += batch_size) {
    const size_t real = std::min<size_t>(batch_size, windows.size() - b);
    std::vector<int64_t> starts(batch_size, windows[b].start);
    for (size_t r = 0; r < real; ++r) starts[r] = windows[b + r].start;
    absl::StatusOr<Tree<Array>> batch =
        device_put(client, window_batch(text, starts, seq), model.mesh(), ShardingRule(model.batch_spec()));
    if (!batch.ok()) return batch.status();
    absl::StatusOr<std::vector<Tree<Array>>> out = eval({params, *batch});
    absl::StatusOr<HostArray> losses = out.ok() ? out->at(0).find("")->fetch() : out.status();
    if (!losses.ok()) return losses.status();
    for (size_t r = 0; r < real; ++r) {
      for (int64_t t = windows[b + r].first_counted; t < seq; ++t) {
        total += losses->element_as_double(static_cast<int64_t>(r) * seq + t);
        ++counted;
      }
    }
  }
  return total / static_cast<double>(counted);
}

}  // namespace tessera::transformer

#endif  // TESSERA_EXAMPLES_TRANSFORMER_MODEL_H_
