// example_transformer: a decoder-only character-level language model (examples/
// transformer_model.h) trained on the GNU GPL version 3 as every Debian system ships it
// (/usr/share/common-licenses/GPL-3), the last 10% held out, on a DATAxMODEL mesh of
// Client::local(R*C) or a running cluster, under one of four layouts (--parallel).
//
//   example_transformer [--parallel=dp|tp|fsdp|fsdp_tp] [--mesh=4x2] [--steps=400] ...
//
// Characters are bytes (vocab 256). Prints "step S loss L tokens/s T" every --print_every
// steps, then "held-out loss: L (...)" (mean nats per character over the held-out text, each
// character counted once, in windows of --seq every --eval_stride characters, following the
// training text's end with --eval_after_train; transformer::eval_windows) and a greedy sample
// of 200 characters after a fixed prompt. Parameters are drawn on the devices from
// tessera::random (--seed), batches from a host generator of the same seed, so every mesh and
// layout trains the same model (to float32 rounding). Exits non-zero when the text cannot be
// read or a step fails.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <numeric>
#include <random>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "core/daemon.h"
#include "examples/mesh_flag.h"
#include "examples/transformer_model.h"
#include "tessera/tessera.h"
#include "worker/kernels/blas.h"

ABSL_FLAG(std::string, text, "/usr/share/common-licenses/GPL-3", "the training text (bytes are the characters)");
ABSL_FLAG(std::string, parallel, "dp",
          "layout: dp (batch over 'data' and 'model', parameters replicated), tp (Megatron: heads and MLP hidden over "
          "'model'), fsdp (batch, parameters and "
          "optimiser state split over 'data' and 'model', gathered for use), fsdp_tp (tp, with the batch, parameters "
          "and optimiser state over 'data')");
ABSL_FLAG(std::string, mesh, "4x2", "DATAxMODEL mesh shape (e.g. 4x2, 8x1, 1x1)");
ABSL_FLAG(std::string, coordinator, "",
          "host:port of a running cluster's coordinator; empty runs Client::local(DATA*MODEL) (env "
          "TESSERA_COORDINATOR)");
ABSL_FLAG(int64_t, vocab, 256, "vocabulary size (at least 256: tokens are bytes)");
ABSL_FLAG(int64_t, d_model, 128, "model width");
ABSL_FLAG(int64_t, heads, 4, "attention heads (must divide --d_model)");
ABSL_FLAG(int64_t, layers, 4, "transformer blocks (one scan over stacked parameters)");
ABSL_FLAG(int64_t, seq, 128, "context length in characters");
ABSL_FLAG(int64_t, batch, 32, "sequences per step");
ABSL_FLAG(int64_t, steps, 400,
          "training steps (the defaults: about 10 minutes on dp 4x2 on 2 quiet cores; the loss leaves its bigram-level "
          "plateau after about 150 steps)");
ABSL_FLAG(int64_t, warmup, 20, "linear learning-rate warmup steps (then cosine decay to lr/10 at --steps)");
ABSL_FLAG(double, lr, 3e-3, "peak AdamW learning rate");
ABSL_FLAG(std::string, remat, "none",
          "what each block keeps for the backward pass: none (everything), dots (its matmuls' results; the rest "
          "is recomputed), full (only its input; jax.checkpoint)");
ABSL_FLAG(double, weight_decay, 0.01, "AdamW's decoupled weight decay");
ABSL_FLAG(double, dropout, 0.0,
          "dropout rate on the embeddings and the blocks' residual branches in training (flax nn.Dropout; none in "
          "evaluation and sampling), drawn on the devices from the seed's key folded with the step");
ABSL_FLAG(double, attention_dropout, 0.0,
          "dropout rate on the attention probabilities in training (GPT-2's attn_pdrop; none in evaluation and "
          "sampling)");
ABSL_FLAG(int64_t, seed, 0, "seed of the parameters (tessera::random on the devices) and of the batches");
ABSL_FLAG(int64_t, print_every, 50, "print the loss every N steps");
ABSL_FLAG(int64_t, eval_every, 0,
          "also print the held-out loss every N steps (0: only at the end), to see where it is lowest");
ABSL_FLAG(int64_t, eval_stride, 0,
          "the held-out evaluation's windows of --seq start every N characters and count only the predictions no "
          "earlier window made, so each character is counted once with at least seq - N + 1 characters of context "
          "after the first window (HF transformers' strided perplexity); 0: --seq / 2; --seq: consecutive windows");
ABSL_FLAG(bool, eval_after_train, true,
          "evaluate the held-out text as the continuation of the training text: its first window's context is "
          "the training text's end (false: the held-out text alone, its first character not predicted)");
ABSL_FLAG(int64_t, sample, 200, "characters of greedy sample to print");

namespace {

using namespace tessera;
using transformer::Config;

int fail(const absl::Status& status) {
  std::cerr << "example_transformer: " << status << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  ensure_fast_blas(argv);  // the in-process workers compute with this process's OpenBLAS
  absl::SetProgramUsageMessage(
      "Trains a character-level transformer language model on the GPL-3 text on a sharded mesh.\n"
      "Usage: example_transformer [--parallel=dp|tp|fsdp|fsdp_tp] [--mesh=4x2] [--steps=400] [--coordinator=H:P]");
  parse_flags(argc, argv, "example_transformer", {{"coordinator", "TESSERA_COORDINATOR"}});
  absl::StatusOr<std::pair<int64_t, int64_t>> mesh_sizes = parse_mesh_flag(absl::GetFlag(FLAGS_mesh));
  if (!mesh_sizes.ok()) return fail(mesh_sizes.status());
  const auto [data_size, model_size] = *mesh_sizes;
  absl::StatusOr<transformer::Layout> layout = transformer::parse_layout(absl::GetFlag(FLAGS_parallel));
  if (!layout.ok()) return fail(layout.status());
  Config c;
  c.vocab = absl::GetFlag(FLAGS_vocab);
  c.d_model = absl::GetFlag(FLAGS_d_model);
  c.heads = absl::GetFlag(FLAGS_heads);
  c.layers = absl::GetFlag(FLAGS_layers);
  c.seq = absl::GetFlag(FLAGS_seq);
  c.batch = absl::GetFlag(FLAGS_batch);
  c.steps = absl::GetFlag(FLAGS_steps);
  c.warmup = absl::GetFlag(FLAGS_warmup);
  c.lr = absl::GetFlag(FLAGS_lr);
  c.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  c.remat = absl::GetFlag(FLAGS_remat);
  c.dropout = absl::GetFlag(FLAGS_dropout);
  c.attention_dropout = absl::GetFlag(FLAGS_attention_dropout);
  if (!(c.dropout >= 0 && c.dropout < 1 && c.attention_dropout >= 0 && c.attention_dropout < 1)) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("--dropout=", c.dropout, " and --attention_dropout=", c.attention_dropout, " must be in [0, 1)")));
  }
  if (absl::Status r = transformer::check_remat(c.remat); !r.ok()) return fail(r);
  const int64_t print_every = std::max<int64_t>(1, absl::GetFlag(FLAGS_print_every));
  if (c.vocab < 256 || c.d_model < 1 || c.heads < 1 || c.d_model % c.heads != 0 || c.layers < 1 || c.seq < 2 ||
      c.batch < 1 || c.steps < 1) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "--vocab=", c.vocab, " (>= 256), --d_model=", c.d_model, " (divisible by --heads=", c.heads, "), --layers=",
        c.layers, ", --seq=", c.seq, " (>= 2), --batch=", c.batch, " and --steps=", c.steps, " must be positive")));
  }
  const int64_t eval_stride = absl::GetFlag(FLAGS_eval_stride) == 0 ? c.seq / 2 : absl::GetFlag(FLAGS_eval_stride);
  if (eval_stride < 1 || eval_stride > c.seq) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("--eval_stride=", eval_stride, " must be in [1, --seq=", c.seq, "] (0: --seq / 2)")));
  }
  // The devices the batch is split over: dp's and fsdp's over both axes, tp's and fsdp_tp's over 'data'.
  const int64_t batch_ways = transformer::data_parallel_axes(*layout).size() == 2 ? data_size * model_size : data_size;
  if (c.batch % batch_ways != 0 || c.heads % model_size != 0 || c.hidden() % model_size != 0) {
    return fail(absl::InvalidArgumentError(absl::StrCat("--batch=", c.batch, " must divide by ", batch_ways,
                                                        " and --heads=", c.heads, " by ", model_size)));
  }
  std::string text;
  {
    std::ifstream in(absl::GetFlag(FLAGS_text), std::ios::binary);
    if (!in) return fail(absl::NotFoundError(absl::StrCat("cannot open --text=", absl::GetFlag(FLAGS_text))));
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  const int64_t n_train = static_cast<int64_t>(text.size()) * 9 / 10;
  const std::string train = text.substr(0, n_train), held_out = text.substr(n_train);
  if (static_cast<int64_t>(train.size()) <= c.seq + 1 || static_cast<int64_t>(held_out.size()) <= c.seq + 1) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("--text has ", text.size(), " bytes: too short for --seq=", c.seq, " with 10% held out")));
  }

  const std::string address = absl::GetFlag(FLAGS_coordinator);
  const int n_devices = static_cast<int>(data_size * model_size);
  absl::StatusOr<Client> client =
      address.empty() ? Client::local(n_devices) : Client::connect(address, {.min_devices = n_devices});
  if (!client.ok()) return fail(client.status());
  std::vector<int> devices(n_devices);
  std::iota(devices.begin(), devices.end(), 0);
  // Auto axes: the layouts are sharding rules the compiler propagates from (GSPMD), as
  // jax.make_mesh(..., axis_types=(Auto, Auto)); on make_mesh's default Explicit axes JAX >= 0.9
  // refuses the embedding gradient of a batch-split step (a scatter-add of batch-split indices).
  absl::StatusOr<Mesh> mesh =
      client->make_mesh({data_size, model_size}, {"data", "model"}, devices, {AxisType::kAuto, AxisType::kAuto});
  if (!mesh.ok()) return fail(mesh.status());
  const transformer::Model model(c, *layout, *mesh);

  // Parameters on the devices, from the seed's key; the optimiser state beside them.
  const int64_t seed = absl::GetFlag(FLAGS_seed);
  HostArray key = HostArray::from_vector<uint32_t>(
      {2}, {static_cast<uint32_t>(static_cast<uint64_t>(seed) >> 32), static_cast<uint32_t>(seed)});
  absl::StatusOr<Array> key_array = client->device_put(key, NamedSharding(*mesh, P()));
  if (!key_array.ok()) return fail(key_array.status());
  absl::StatusOr<std::vector<Tree<Array>>> params = model.init()({Tree<Array>(*key_array)});
  if (!params.ok()) return fail(params.status());
  absl::StatusOr<std::vector<Tree<Array>>> state = model.optimizer_init()({(*params)[0]});
  if (!state.ok()) return fail(state.status());
  Tree<Array> p = (*params)[0], s = (*state)[0];
  int64_t n_params = 0;
  for (const auto& [name, a] : p) n_params += static_cast<int64_t>(a.size());
  std::printf(
      "transformer: %lld parameters, %lld layers, d_model %lld, %lld heads, seq %lld, batch %lld, dropout %g, "
      "attention dropout %g, weight decay %g; %s on %s\n",
      static_cast<long long>(n_params), static_cast<long long>(c.layers), static_cast<long long>(c.d_model),
      static_cast<long long>(c.heads), static_cast<long long>(c.seq), static_cast<long long>(c.batch), c.dropout,
      c.attention_dropout, c.weight_decay, transformer::layout_name(*layout), mesh->to_string().c_str());

  // The held-out loss: mean nats per character, each held-out character counted once, in windows
  // of seq every eval_stride (transformer::eval_windows); with --eval_after_train the text scored
  // is the training text's last seq characters and then the held-out text, whose characters
  // from the first on are counted.
  const TreeJitted eval = model.eval();
  const bool after_train = absl::GetFlag(FLAGS_eval_after_train);
  const std::string scored = after_train ? train.substr(train.size() - c.seq) + held_out : held_out;
  const int64_t first_target = after_train ? c.seq : 1;
  const std::vector<transformer::EvalWindow> windows =
      transformer::eval_windows(static_cast<int64_t>(scored.size()), c.seq, eval_stride, first_target);
  const std::string eval_name =
      absl::StrCat("nats/char over ", scored.size() - first_target, " held-out characters, ", windows.size(),
                   " windows of ", c.seq, " every ", eval_stride, after_train ? ", after the training text" : "");
  auto held_out_loss = [&](const Tree<Array>& params) {
    return transformer::windows_loss(*client, model, eval, params, scored, windows);
  };
  const int64_t eval_every = absl::GetFlag(FLAGS_eval_every);

  const TreeJitted step = model.train_step();
  std::mt19937_64 rng(static_cast<uint64_t>(seed));
  std::uniform_int_distribution<int64_t> start_of(0, static_cast<int64_t>(train.size()) - c.seq - 1);
  absl::Time since = absl::Now();
  for (int64_t i = 1; i <= c.steps; ++i) {
    std::vector<int64_t> starts(c.batch);
    for (int64_t& st : starts) st = start_of(rng);
    absl::StatusOr<Tree<Array>> batch =
        device_put(*client, transformer::window_batch(train, starts, c.seq), *mesh, ShardingRule(model.batch_spec()));
    if (!batch.ok()) return fail(batch.status());
    std::vector<Tree<Array>> args = {p, s, *batch};
    if (c.drops()) {  // the step's dropout key is made on the devices from the seed's key and i
      absl::StatusOr<Array> step_number =
          client->device_put(HostArray::from_vector<int32_t>({}, {static_cast<int32_t>(i)}), NamedSharding(*mesh, P()));
      if (!step_number.ok()) return fail(step_number.status());
      Tree<Array> dropout_tree;
      dropout_tree.set("key", *key_array);
      dropout_tree.set("step", *step_number);
      args.push_back(std::move(dropout_tree));
    }
    absl::StatusOr<std::vector<Tree<Array>>> out = step(args);
    if (!out.ok()) return fail(out.status());
    p = (*out)[1];
    s = (*out)[2];
    if (i % print_every == 0 || i == c.steps) {
      absl::StatusOr<HostArray> loss = out->at(0).find("")->fetch();
      if (!loss.ok()) return fail(loss.status());
      const int64_t done = i % print_every == 0 ? print_every : i % print_every;
      const double seconds = absl::ToDoubleSeconds(absl::Now() - since);
      std::printf("step %lld loss %.4f tokens/s %.0f\n", static_cast<long long>(i), loss->element_as_double(0),
                  static_cast<double>(done * c.batch * c.seq) / seconds);
      std::fflush(stdout);
      since = absl::Now();
    }
    if (eval_every > 0 && i % eval_every == 0 && i < c.steps) {
      absl::StatusOr<double> l = held_out_loss(p);
      if (!l.ok()) return fail(l.status());
      std::printf("step %lld held-out loss %.4f\n", static_cast<long long>(i), *l);
      std::fflush(stdout);
      since = absl::Now();  // the evaluation's time is not the steps'
    }
  }
  absl::StatusOr<double> final_loss = held_out_loss(p);
  if (!final_loss.ok()) return fail(final_loss.status());
  std::printf("held-out loss: %.4f (%s)\n", *final_loss, eval_name.c_str());

  // Greedy sampling: the context (at most seq characters) at positions 0.., the prediction
  // read at its last position. One row per device the batch is split over, all the same.
  const TreeJitted predict = model.predict();
  std::string context = "This program is free software";
  std::string sample;
  for (int64_t k = 0; k < absl::GetFlag(FLAGS_sample); ++k) {
    if (static_cast<int64_t>(context.size()) > c.seq) context = context.substr(context.size() - c.seq);
    HostArray tokens = HostArray::zeros(DType::kI32, {batch_ways, c.seq});
    for (int64_t r = 0; r < batch_ways; ++r) {
      for (size_t t = 0; t < context.size(); ++t) {
        tokens.mutable_values<int32_t>()[r * c.seq + t] = static_cast<unsigned char>(context[t]);
      }
    }
    absl::StatusOr<Array> in = client->device_put(tokens, model.batch_sharding());
    if (!in.ok()) return fail(in.status());
    absl::StatusOr<std::vector<Tree<Array>>> out = predict({p, Tree<Array>(*in)});
    absl::StatusOr<HostArray> next = out.ok() ? out->at(0).find("")->fetch() : out.status();
    if (!next.ok()) return fail(next.status());
    const char ch = static_cast<char>(next->element_as_double(static_cast<int64_t>(context.size()) - 1));
    context.push_back(ch);
    sample.push_back(ch);
  }
  std::printf("sample: This program is free software%s\n", sample.c_str());
  return 0;
}
