// Parameter trees: named, nested arrays passed through jit, grad and device_put as one
// argument, as JAX's pytrees of dicts.
//
//   Tree<HostArray> host;
//   host.set("layers.0.w", std::move(w0));   host.set("layers.0.b", std::move(b0));
//   absl::StatusOr<Tree<Array>> params = device_put(client, host, mesh,
//       ShardingRule::globs({{"*.w", P("data", None)}, {"*", P()}}));   // FSDP-like
//   TreeJitted step = jit([](const std::vector<Tree<Value>>& in) {
//     return std::vector<Tree<Value>>{...};                 // params, state, batch -> ...
//   }, {.donate_argnums = {0, 1}});
//
// A Tree<T> is an ordered map from dotted names ("layers.0.w") to leaves: Array outside a
// trace, Value inside, HostArray on the host, PartitionSpec for shardings. The dots nest:
// "layers.0.w" is leaf "w" of node "0" of node "layers", and set(name, subtree) / subtree(name)
// move whole nodes. A tree of one leaf named "" is that leaf (a Value converts to it), as a
// leaf is a pytree in JAX. Flattening order is JAX's for the nested dict the names spell
// (jax/_src/tree_util.py flattens a dict by sorted keys): names compare part by part at the
// dots, each part as a string — so "a.z" < "a-c" and "layers.10" < "layers.2", as Python
// sorts those keys, and the Python package (python/tessera/tree_util.py) flattens the nested
// dict {"layers": {"0": {"w": ...}}} in the same order as Tree flattens "layers.0.w".
//
// A Tree may hold names that spell no tree ("a" and "a.b": a leaf with leaves under it; an
// empty part as in "a..b"); structure() refuses them, and so does everything that takes a
// tree (jit, grad, device_put, the optimisers), naming the name.
#ifndef TESSERA_TREE_H_
#define TESSERA_TREE_H_

#include <cstddef>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/host_array.h"
#include "core/mesh.h"
#include "core/partition_spec.h"
#include "tessera/array.h"
#include "tessera/client.h"
#include "tessera/trace.h"

namespace tessera {

// The flattening order of names: part by part at the dots (see above).
struct TreeNameLess {
  bool operator()(absl::string_view a, absl::string_view b) const;
};

// `prefix` and `name` joined by a dot; either may be "" (the root).
std::string tree_join(absl::string_view prefix, absl::string_view name);

// The structure of a tree: its leaf names in flattening order. Made by Tree::structure().
class TreeDef {
 public:
  TreeDef() = default;
  const std::vector<std::string>& names() const { return names_; }
  size_t num_leaves() const { return names_.size(); }
  bool operator==(const TreeDef& other) const { return names_ == other.names_; }
  bool operator!=(const TreeDef& other) const { return !(*this == other); }
  // "{a.b, a.z, c}"; "{}" for the empty tree.
  std::string to_string() const;
  // OK when `other` has the same names; otherwise INVALID_ARGUMENT naming the first name in
  // one but not the other: "'b' is in the gradients but not in the parameters".
  absl::Status check_same(const TreeDef& other, absl::string_view this_what, absl::string_view other_what) const;
  // INVALID_ARGUMENT naming the first name that spells no tree. (Tree::structure() calls it.)
  static absl::StatusOr<TreeDef> of(std::vector<std::string> sorted_names);

 private:
  std::vector<std::string> names_;
};

// An ordered map from dotted names to leaves (see above). Copyable when T is.
template <typename T>
class Tree {
 public:
  using Map = std::map<std::string, T, TreeNameLess>;
  // The empty tree (no leaves).
  Tree() = default;
  // A tree of one leaf, named "": the leaf itself.
  Tree(T leaf) { leaves_.emplace(std::string(), std::move(leaf)); }  // NOLINT: implicit, as a leaf is a tree
  Tree(std::initializer_list<std::pair<const std::string, T>> leaves) : leaves_(leaves) {}

  // Puts `subtree` under `name` (its leaf "" becomes `name`, its leaf "x" `name`.x), replacing
  // leaves of the same names. Returns *this.
  Tree& set(absl::string_view name, Tree subtree) {
    for (auto& [sub, leaf] : subtree.leaves_) leaves_.insert_or_assign(tree_join(name, sub), std::move(leaf));
    return *this;
  }
  // The leaves under node (or leaf) `name`, their names relative to it; empty when none.
  Tree subtree(absl::string_view name) const {
    Tree out;
    for (const auto& [n, leaf] : leaves_) {
      if (name.empty()) {
        out.leaves_.emplace(n, leaf);
      } else if (absl::string_view(n) == name) {
        out.leaves_.emplace(std::string(), leaf);
      } else if (n.size() > name.size() && absl::string_view(n).substr(0, name.size()) == name &&
                 n[name.size()] == '.') {
        out.leaves_.emplace(n.substr(name.size() + 1), leaf);
      }
    }
    return out;
  }

  // The leaf named `name`, or null.
  const T* find(absl::string_view name) const {
    auto it = leaves_.find(std::string(name));
    return it == leaves_.end() ? nullptr : &it->second;
  }
  T* find(absl::string_view name) {
    auto it = leaves_.find(std::string(name));
    return it == leaves_.end() ? nullptr : &it->second;
  }
  size_t size() const { return leaves_.size(); }
  bool empty() const { return leaves_.empty(); }
  const Map& leaves_by_name() const { return leaves_; }
  typename Map::const_iterator begin() const { return leaves_.begin(); }
  typename Map::const_iterator end() const { return leaves_.end(); }

  // The names in flattening order, or INVALID_ARGUMENT naming one that spells no tree.
  absl::StatusOr<TreeDef> structure() const {
    std::vector<std::string> names;
    for (const auto& [n, leaf] : leaves_) names.push_back(n);
    return TreeDef::of(std::move(names));
  }
  // The leaves in flattening order (the tree's structure() must be OK for unflatten to undo it).
  std::vector<T> flatten() const& {
    std::vector<T> out;
    for (const auto& [n, leaf] : leaves_) out.push_back(leaf);
    return out;
  }
  std::vector<T> flatten() && {
    std::vector<T> out;
    for (auto& [n, leaf] : leaves_) out.push_back(std::move(leaf));
    return out;
  }
  // The tree of `def` with `leaves` in its order. INVALID_ARGUMENT when the counts differ.
  static absl::StatusOr<Tree> unflatten(const TreeDef& def, std::vector<T> leaves) {
    if (leaves.size() != def.num_leaves()) {
      return absl::InvalidArgumentError(absl::StrCat("tree: unflatten of ", def.to_string(), " (", def.num_leaves(),
                                                     " leaves) from ", leaves.size(), " leaves"));
    }
    Tree out;
    for (size_t i = 0; i < leaves.size(); ++i) out.leaves_.emplace(def.names()[i], std::move(leaves[i]));
    return out;
  }

 private:
  Map leaves_;
};

// f(name, leaf) of every leaf, in a tree of the same names.
template <typename T, typename F>
auto tree_map(const Tree<T>& tree, F f) -> Tree<decltype(f(std::string(), *tree.find("")))> {
  Tree<decltype(f(std::string(), *tree.find("")))> out;
  for (const auto& [name, leaf] : tree) out.set(name, f(name, leaf));
  return out;
}

// How the leaves of a tree get their shardings, by name: one spec for every leaf, a tree of
// specs with each leaf's own, glob rules (fnmatch(3) patterns over the whole name, the first
// that matches wins, as flax's and t5x's partitioning rules use regexes), or any function.
class ShardingRule {
 public:
  using Function = std::function<std::optional<PartitionSpec>(absl::string_view name)>;
  ShardingRule(PartitionSpec all);                    // NOLINT: every leaf
  ShardingRule(const Tree<PartitionSpec>& per_name);  // NOLINT: exactly these names
  explicit ShardingRule(Function f) : f_(std::move(f)) {}
  // {{"*.w", P("data", None)}, {"*", P()}}: `*` matches any run of characters (dots too),
  // `?` one, [...] a class.
  static ShardingRule globs(std::vector<std::pair<std::string, PartitionSpec>> rules);
  // The spec of leaf `name`; INVALID_ARGUMENT naming it when the rule gives none.
  absl::StatusOr<PartitionSpec> spec_for(absl::string_view name) const;

 private:
  Function f_;
};

// jax.device_put of a tree: each leaf placed with the sharding `rule` gives its name on
// `mesh`. Client::device_put's errors, prefixed with the leaf's name; the rule's errors; the
// tree's structure() error. On error, the leaves placed so far are released.
absl::StatusOr<Tree<Array>> device_put(const Client& client, const Tree<HostArray>& host, const Mesh& mesh,
                                       const ShardingRule& rule);
// jax.device_get of a tree: every leaf fetched (as tessera::device_get, in parallel).
absl::StatusOr<Tree<HostArray>> device_get(const Tree<Array>& arrays);
// The sharding spec of every leaf.
Tree<PartitionSpec> shardings_of(const Tree<Array>& arrays);

// A traced function of trees: each argument and each result a Tree<Value>.
using TreeFunction = std::function<std::vector<Tree<Value>>(const std::vector<Tree<Value>>&)>;

// grad and value_and_grad (tessera/grad.h) over trees: the gradients of f's first result, a
// tree of one float scalar leaf, with respect to the argument trees `argnums`, one gradient
// tree per argnum with its argument's names (and each leaf's sharding). Errors fail the
// trace with INVALID_ARGUMENT: those of grad, and a differentiated leaf that is not float or
// a first result of more than one leaf, naming them.
TreeFunction grad(TreeFunction f, std::vector<int> argnums = {0});
TreeFunction value_and_grad(TreeFunction f, std::vector<int> argnums = {0});

// How jit compiles a function of trees (JitOptions, per tree).
struct TreeJitOptions {
  // One entry per argument tree (or empty): the shardings its leaves must have (as
  // JitOptions::in_shardings: a mismatch is INVALID_ARGUMENT naming the leaf); nullopt accepts any.
  std::vector<std::optional<ShardingRule>> in_shardings = {};
  // One entry per result tree (or empty): the shardings its leaves get (each pinned with
  // with_sharding_constraint); nullopt lets propagation choose.
  std::vector<std::optional<ShardingRule>> out_shardings = {};
  // Argument trees the call takes over, every leaf (JitOptions::donate_argnums).
  std::vector<int> donate_argnums = {};
  absl::Duration timeout = absl::Seconds(60);
};

// A function of trees compiled by jit: the leaves are flattened (in the order above) into one
// Jitted's arguments and results. A Jitted per argument structure (names and mesh; at most 64,
// RESOURCE_EXHAUSTED beyond): a call with other names traces and compiles again, as JAX
// retraces for another pytree structure. Copies share the compilations.
class TreeJitted {
 public:
  TreeJitted(TreeFunction f, TreeJitOptions options);
  // Jitted::operator()'s behaviour and errors, and INVALID_ARGUMENT for an argument tree whose
  // structure() fails, no leaves in all, options that do not fit (naming the tree and leaf),
  // or a result that is not a valid tree or whose structure depends on more than the
  // arguments' names (one trace gave other result names than the last).
  absl::StatusOr<std::vector<Tree<Array>>> operator()(const std::vector<Tree<Array>>& args) const;
  // Jitted::as_text and compilations of the most recently used structure.
  std::string as_text() const;
  int64_t compilations() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// jax.jit of a function of trees.
TreeJitted jit(TreeFunction f, TreeJitOptions options = {});

}  // namespace tessera

#endif  // TESSERA_TREE_H_
