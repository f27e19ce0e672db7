#include "tessera/tree.h"

#include <fnmatch.h>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "client/trace_state.h"
#include "core/status.h"
#include "tessera/grad.h"
#include "tessera/jit.h"

namespace tessera {

using internal::TraceState;

bool TreeNameLess::operator()(absl::string_view a, absl::string_view b) const {
  while (true) {
    const size_t da = a.find('.'), db = b.find('.');
    const absl::string_view pa = a.substr(0, da), pb = b.substr(0, db);
    if (pa != pb) return pa < pb;
    if (da == absl::string_view::npos || db == absl::string_view::npos) {
      return da == absl::string_view::npos && db != absl::string_view::npos;  // a prefix comes first
    }
    a.remove_prefix(da + 1);
    b.remove_prefix(db + 1);
  }
}

std::string tree_join(absl::string_view prefix, absl::string_view name) {
  if (prefix.empty()) return std::string(name);
  if (name.empty()) return std::string(prefix);
  return absl::StrCat(prefix, ".", name);
}

std::string TreeDef::to_string() const { return absl::StrCat("{", absl::StrJoin(names_, ", "), "}"); }

absl::Status TreeDef::check_same(const TreeDef& other, absl::string_view this_what,
                                 absl::string_view other_what) const {
  const TreeNameLess less;
  for (size_t i = 0, j = 0; i < names_.size() || j < other.names_.size();) {
    const bool mine = j == other.names_.size() || (i < names_.size() && less(names_[i], other.names_[j]));
    const bool theirs = i == names_.size() || (j < other.names_.size() && less(other.names_[j], names_[i]));
    if (mine || theirs) {
      return absl::InvalidArgumentError(absl::StrCat("'", mine ? names_[i] : other.names_[j], "' is in the ",
                                                     mine ? this_what : other_what, " but not in the ",
                                                     mine ? other_what : this_what));
    }
    ++i, ++j;
  }
  return absl::OkStatus();
}

absl::StatusOr<TreeDef> TreeDef::of(std::vector<std::string> sorted_names) {
  for (size_t i = 0; i < sorted_names.size(); ++i) {
    const std::string& n = sorted_names[i];
    if (n.empty() && sorted_names.size() > 1) {
      return absl::InvalidArgumentError(absl::StrCat("tree: a leaf named '' (the root) and also '", sorted_names[1],
                                                     "'; a tree is one leaf or named leaves"));
    }
    for (absl::string_view part : absl::StrSplit(n, '.')) {
      if (part.empty() && !n.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("tree: the name '", n, "' has an empty part"));
      }
    }
    if (i > 0 && !sorted_names[i - 1].empty() && n.size() > sorted_names[i - 1].size() &&
        n.compare(0, sorted_names[i - 1].size(), sorted_names[i - 1]) == 0 && n[sorted_names[i - 1].size()] == '.') {
      return absl::InvalidArgumentError(
          absl::StrCat("tree: '", sorted_names[i - 1], "' is a leaf and also has leaves under it ('", n, "')"));
    }
  }
  TreeDef def;
  def.names_ = std::move(sorted_names);
  return def;
}

ShardingRule::ShardingRule(PartitionSpec all)
    : f_([all = std::move(all)](absl::string_view) { return std::optional<PartitionSpec>(all); }) {}

ShardingRule::ShardingRule(const Tree<PartitionSpec>& per_name)
    : f_([per_name](absl::string_view name) {
        const PartitionSpec* spec = per_name.find(name);
        return spec == nullptr ? std::nullopt : std::optional<PartitionSpec>(*spec);
      }) {}

ShardingRule ShardingRule::globs(std::vector<std::pair<std::string, PartitionSpec>> rules) {
  return ShardingRule([rules = std::move(rules)](absl::string_view name) -> std::optional<PartitionSpec> {
    const std::string n(name);
    for (const auto& [pattern, spec] : rules) {
      if (fnmatch(pattern.c_str(), n.c_str(), 0) == 0) return spec;
    }
    return std::nullopt;
  });
}

absl::StatusOr<PartitionSpec> ShardingRule::spec_for(absl::string_view name) const {
  std::optional<PartitionSpec> spec = f_ ? f_(name) : std::nullopt;
  if (!spec.has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("the sharding rule gives no spec for leaf '", name, "'"));
  }
  return *std::move(spec);
}

absl::StatusOr<Tree<Array>> device_put(const Client& client, const Tree<HostArray>& host, const Mesh& mesh,
                                       const ShardingRule& rule) {
  TESSERA_RETURN_IF_ERROR(host.structure().status());
  Tree<Array> out;
  for (const auto& [name, leaf] : host) {
    absl::StatusOr<PartitionSpec> spec = rule.spec_for(name);
    absl::StatusOr<Array> a = spec.ok() ? client.device_put(leaf, NamedSharding(mesh, *spec)) : spec.status();
    if (!a.ok()) {
      return absl::Status(a.status().code(), absl::StrCat("device_put: '", name, "': ", a.status().message()));
    }
    out.set(name, *std::move(a));
  }
  return out;
}

absl::StatusOr<Tree<HostArray>> device_get(const Tree<Array>& arrays) {
  TESSERA_ASSIGN_OR_RETURN(TreeDef def, arrays.structure());
  TESSERA_ASSIGN_OR_RETURN(std::vector<HostArray> hosts, device_get(arrays.flatten()));
  return Tree<HostArray>::unflatten(def, std::move(hosts));
}

Tree<PartitionSpec> shardings_of(const Tree<Array>& arrays) {
  return tree_map(arrays, [](const std::string&, const Array& a) { return a.sharding().spec(); });
}

namespace {

// The trees of `defs` from consecutive runs of `flat`. REQUIRES: the counts add up.
std::vector<Tree<Value>> unflatten_all(const std::vector<TreeDef>& defs, const std::vector<Value>& flat) {
  std::vector<Tree<Value>> out;
  size_t k = 0;
  for (const TreeDef& def : defs) {
    std::vector<Value> leaves(flat.begin() + k, flat.begin() + k + def.num_leaves());
    k += def.num_leaves();
    out.push_back(*Tree<Value>::unflatten(def, std::move(leaves)));
  }
  return out;
}

// value_and_grad over trees; {value?, one gradient tree per argnum}.
std::vector<Tree<Value>> tree_value_and_grads(const TreeFunction& f, const std::vector<int>& argnums,
                                              const std::vector<Tree<Value>>& args, bool with_value) {
  std::vector<Tree<Value>> failed(argnums.size() + (with_value ? 1 : 0));
  TraceState* t = TraceState::current;
  for (const Tree<Value>& a : args) {
    for (const auto& [name, v] : a) {
      if (v.ok()) t = TraceState::of(v);
    }
  }
  if (t == nullptr) return failed;
  auto fail = [&](const std::string& message) {
    t->fail(absl::InvalidArgumentError(absl::StrCat("grad: ", message)));
    return failed;
  };
  std::vector<TreeDef> defs;
  std::vector<Value> flat;
  std::vector<size_t> offsets;
  for (size_t i = 0; i < args.size(); ++i) {
    absl::StatusOr<TreeDef> def = args[i].structure();
    if (!def.ok()) return fail(absl::StrCat("argument ", i, ": ", def.status().message()));
    offsets.push_back(flat.size());
    for (const Value& v : args[i].flatten()) flat.push_back(v);
    defs.push_back(*std::move(def));
  }
  std::vector<int> flat_argnums;
  for (int k : argnums) {
    if (k < 0 || k >= static_cast<int>(args.size())) {
      return fail(absl::StrCat("argnum ", k, " is out of range for ", args.size(), " arguments"));
    }
    for (size_t j = 0; j < defs[k].num_leaves(); ++j) {
      const Value& v = flat[offsets[k] + j];
      if (v.ok() && !is_floating(v.dtype())) {
        return fail(absl::StrCat("argument ", k, " leaf '", defs[k].names()[j], "' is ",
                                 type_to_string(v.dtype(), v.shape()),
                                 "; gradients need float inputs (as JAX's grad requires real-valued inputs)"));
      }
      flat_argnums.push_back(static_cast<int>(offsets[k] + j));
    }
  }
  TracedFunction flat_f = [&](const std::vector<Value>& in) -> std::vector<Value> {
    std::vector<Tree<Value>> out = f(unflatten_all(defs, in));
    if (out.empty()) return {};
    if (out[0].size() != 1) {
      t->fail(absl::InvalidArgumentError(absl::StrCat("grad: the function's first result has ", out[0].size(),
                                                      " leaves; it must be one float scalar")));
      return {};
    }
    return {out[0].begin()->second};
  };
  std::vector<Value> r = tessera::value_and_grad(flat_f, flat_argnums)(flat);
  if (!t->error.ok()) return failed;
  std::vector<Tree<Value>> out;
  if (with_value) out.push_back(r[0]);
  size_t k = 1;
  for (int a : argnums) {
    std::vector<Value> leaves(r.begin() + k, r.begin() + k + defs[a].num_leaves());
    k += defs[a].num_leaves();
    out.push_back(*Tree<Value>::unflatten(defs[a], std::move(leaves)));
  }
  return out;
}

}  // namespace

TreeFunction grad(TreeFunction f, std::vector<int> argnums) {
  return [f = std::move(f), argnums = std::move(argnums)](const std::vector<Tree<Value>>& args) {
    return tree_value_and_grads(f, argnums, args, false);
  };
}

TreeFunction value_and_grad(TreeFunction f, std::vector<int> argnums) {
  return [f = std::move(f), argnums = std::move(argnums)](const std::vector<Tree<Value>>& args) {
    return tree_value_and_grads(f, argnums, args, true);
  };
}

// ---- jit over trees ----------------------------------------------------------------------

struct TreeJitted::State {
  static constexpr size_t kMaxStructures = 64;
  TreeFunction f;
  TreeJitOptions options;
  // One argument structure on one mesh: its Jitted, and the result structure its trace gave.
  struct Entry {
    Entry(std::vector<TreeDef> defs, Mesh m) : in_defs(std::move(defs)), mesh(std::move(m)) {}
    const std::vector<TreeDef> in_defs;
    const Mesh mesh;
    std::optional<Jitted> jitted;  // set once, right after construction
    absl::Mutex mu;
    std::optional<std::vector<TreeDef>> out_defs ABSL_GUARDED_BY(mu);
  };
  // The flat function `entry`'s Jitted traces: trees in, f, trees out (pinned as
  // out_shardings says), recording the result structure.
  std::vector<Value> flat_call(Entry* entry, const std::vector<Value>& flat) const;

  absl::Mutex mu;
  std::map<std::string, std::shared_ptr<Entry>> entries ABSL_GUARDED_BY(mu);
  std::shared_ptr<Entry> last ABSL_GUARDED_BY(mu);
};

std::vector<Value> TreeJitted::State::flat_call(Entry* entry, const std::vector<Value>& flat) const {
  TraceState* t = TraceState::current;
  auto fail = [&](const std::string& message) {
    if (t != nullptr) t->fail(absl::InvalidArgumentError(absl::StrCat("jit: ", message)));
    return std::vector<Value>();
  };
  std::vector<Tree<Value>> out = f(unflatten_all(entry->in_defs, flat));
  if (t != nullptr && !t->error.ok()) return {};
  const std::vector<std::optional<ShardingRule>>& rules = options.out_shardings;
  if (!rules.empty() && rules.size() != out.size()) {
    return fail(absl::StrCat("out_shardings has ", rules.size(), " entries for ", out.size(), " result trees"));
  }
  std::vector<TreeDef> defs;
  std::vector<Value> results;
  for (size_t i = 0; i < out.size(); ++i) {
    absl::StatusOr<TreeDef> def = out[i].structure();
    if (!def.ok()) return fail(absl::StrCat("result tree ", i, ": ", def.status().message()));
    for (const auto& [name, v] : out[i]) {
      if (rules.empty() || !rules[i].has_value()) {
        results.push_back(v);
        continue;
      }
      absl::StatusOr<PartitionSpec> spec = rules[i]->spec_for(name);
      if (!spec.ok()) return fail(absl::StrCat("result tree ", i, ": ", spec.status().message()));
      results.push_back(with_sharding_constraint(v, NamedSharding(entry->mesh, *spec)));
    }
    defs.push_back(*std::move(def));
  }
  absl::MutexLock lock(&entry->mu);
  if (entry->out_defs.has_value() && *entry->out_defs != defs) {
    return fail(
        "the function's result trees have other names for other argument types; their names may depend on "
        "the arguments' names only");
  }
  entry->out_defs = std::move(defs);
  return results;
}

TreeJitted::TreeJitted(TreeFunction f, TreeJitOptions options) : state_(std::make_shared<State>()) {
  state_->f = std::move(f);
  state_->options = std::move(options);
}

TreeJitted jit(TreeFunction f, TreeJitOptions options) { return TreeJitted(std::move(f), std::move(options)); }

absl::StatusOr<std::vector<Tree<Array>>> TreeJitted::operator()(const std::vector<Tree<Array>>& args) const {
  const TreeJitOptions& options = state_->options;
  if (!options.in_shardings.empty() && options.in_shardings.size() != args.size()) {
    return absl::InvalidArgumentError(absl::StrCat("jit: in_shardings has ", options.in_shardings.size(),
                                                   " entries for ", args.size(), " argument trees"));
  }
  std::vector<TreeDef> defs;
  std::vector<Array> flat;
  std::vector<int> donate;
  for (int k : options.donate_argnums) {
    if (k < 0 || k >= static_cast<int>(args.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat("jit: donate_argnums names argument tree ", k, " of a call with ", args.size()));
    }
  }
  std::string key;
  for (size_t i = 0; i < args.size(); ++i) {
    absl::StatusOr<TreeDef> def = args[i].structure();
    if (!def.ok())
      return absl::InvalidArgumentError(absl::StrCat("jit: argument tree ", i, ": ", def.status().message()));
    const bool donated = std::find(options.donate_argnums.begin(), options.donate_argnums.end(), static_cast<int>(i)) !=
                         options.donate_argnums.end();
    for (const auto& [name, a] : args[i]) {
      if (donated) donate.push_back(static_cast<int>(flat.size()));
      flat.push_back(a);
      if (options.in_shardings.empty() || !options.in_shardings[i].has_value()) continue;
      absl::StatusOr<PartitionSpec> spec = options.in_shardings[i]->spec_for(name);
      if (!spec.ok())
        return absl::InvalidArgumentError(absl::StrCat("jit: in_shardings[", i, "]: ", spec.status().message()));
      const NamedSharding wanted(a.sharding().mesh(), *spec);
      absl::Status fits = wanted.validate(a.shape());
      if (!fits.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("jit: argument tree ", i, " leaf '", name, "' ",
                                                       type_to_string(a.dtype(), a.shape()), ": ", fits.message(),
                                                       " (in_shardings[", i, "])"));
      }
      if (!wanted.is_equivalent_to(a.sharding(), static_cast<int>(a.shape().size()))) {
        return absl::InvalidArgumentError(absl::StrCat(
            "jit: argument tree ", i, " leaf '", name, "' has sharding ", a.sharding().spec().to_string(),
            " but in_shardings[", i, "] gives ", spec->to_string(),
            "; committed arrays are not moved implicitly (as in JAX): device_put it with the wanted sharding"));
      }
    }
    absl::StrAppend(&key, def->to_string(), ";");
    defs.push_back(*std::move(def));
  }
  if (flat.empty()) return absl::InvalidArgumentError("jit: the argument trees have no leaves");
  const Mesh& mesh = flat[0].sharding().mesh();
  absl::StrAppend(&key, mesh.to_string(), absl::StrJoin(mesh.device_ids(), ","));
  std::shared_ptr<State::Entry> entry;
  {
    absl::MutexLock lock(&state_->mu);
    auto it = state_->entries.find(key);
    if (it != state_->entries.end()) {
      entry = it->second;
    } else {
      if (state_->entries.size() >= State::kMaxStructures) {
        return absl::ResourceExhaustedError(
            absl::StrCat("jit: this function was called with ", State::kMaxStructures,
                         " argument structures (tree names and meshes) already; the limit is ", State::kMaxStructures));
      }
      entry = std::make_shared<State::Entry>(defs, mesh);
      JitOptions flat_options;
      flat_options.timeout = options.timeout;
      flat_options.donate_argnums = donate;
      // The entry owns its Jitted, which holds this function: a raw pointer, no cycle.
      entry->jitted =
          jit([state = state_.get(), e = entry.get()](const std::vector<Value>& in) { return state->flat_call(e, in); },
              std::move(flat_options));
      state_->entries.emplace(key, entry);
    }
    state_->last = entry;
  }
  TESSERA_ASSIGN_OR_RETURN(std::vector<Array> results, (*entry->jitted)(flat));
  std::vector<TreeDef> out_defs;
  {
    absl::MutexLock lock(&entry->mu);
    if (entry->out_defs.has_value()) out_defs = *entry->out_defs;
  }
  std::vector<Tree<Array>> out;
  size_t k = 0;
  for (const TreeDef& def : out_defs) {
    if (k + def.num_leaves() > results.size()) break;
    std::vector<Array> leaves(results.begin() + k, results.begin() + k + def.num_leaves());
    k += def.num_leaves();
    out.push_back(*Tree<Array>::unflatten(def, std::move(leaves)));
  }
  if (k != results.size() || out.size() != out_defs.size()) {
    return absl::InternalError(absl::StrCat("jit: ", results.size(), " results for result trees of ", k, " leaves"));
  }
  return out;
}

std::string TreeJitted::as_text() const {
  std::shared_ptr<State::Entry> last;
  {
    absl::MutexLock lock(&state_->mu);
    last = state_->last;
  }
  return last == nullptr ? "" : last->jitted->as_text();
}

int64_t TreeJitted::compilations() const {
  std::shared_ptr<State::Entry> last;
  {
    absl::MutexLock lock(&state_->mu);
    last = state_->last;
  }
  return last == nullptr ? 0 : last->jitted->compilations();
}

}  // namespace tessera
