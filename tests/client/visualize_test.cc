// visualize_sharding against the pictures JAX prints (jax.debug.visualize_sharding without
// colour, as JAX's own tests check it). Each expected picture says where it comes from: JAX's
// tests, JAX's docs (their TPU devices read as CPU, and the docs' device order reproduced with
// the mesh's device ids), or, where JAX shows no picture of the case, the algorithm of
// jax/_src/debugging.py (visualize_sharding: sizes from the array's shape ratio, tiles 9 to 80
// columns wide, rich's SQUARE box) run with rich 13.3.1 on the same shape, mesh and spec, by
// tests/client/visualize_reference.py (which also reproduces every picture cited from JAX).
#include "tessera/visualize.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace tessera {
namespace {

using ::testing::HasSubstr;

std::string picture(const Shape& shape, std::vector<int64_t> mesh_shape, std::vector<std::string> names,
                    const PartitionSpec& spec, std::vector<int> ids) {
  absl::StatusOr<Mesh> mesh = Mesh::create(std::move(mesh_shape), std::move(names), std::move(ids));
  if (!mesh.ok()) return mesh.status().ToString();
  absl::StatusOr<std::string> out = visualize_sharding(shape, NamedSharding(*mesh, spec));
  return out.ok() ? *out : out.status().ToString();
}

// JAX tests/debugging_primitives_test.py test_trivial_sharding.
TEST(VisualizeSharding, JaxTestTrivialSharding) {
  EXPECT_EQ(picture({5}, {1}, {"x"}, P("x"), {0}),
            "┌───────┐\n"
            "│ CPU 0 │\n"
            "└───────┘\n");
}

// JAX tests/debugging_primitives_test.py test_full_sharding.
TEST(VisualizeSharding, JaxTestFullSharding32Devices) {
  EXPECT_EQ(picture({8, 8}, {8, 4}, {"x", "y"}, P("x", "y"),
                    {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                     16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31}),
            "┌───────┬───────┬───────┬───────┐\n"
            "│ CPU 0 │ CPU 1 │ CPU 2 │ CPU 3 │\n"
            "├───────┼───────┼───────┼───────┤\n"
            "│ CPU 4 │ CPU 5 │ CPU 6 │ CPU 7 │\n"
            "├───────┼───────┼───────┼───────┤\n"
            "│ CPU 8 │ CPU 9 │CPU 10 │CPU 11 │\n"
            "├───────┼───────┼───────┼───────┤\n"
            "│CPU 12 │CPU 13 │CPU 14 │CPU 15 │\n"
            "├───────┼───────┼───────┼───────┤\n"
            "│CPU 16 │CPU 17 │CPU 18 │CPU 19 │\n"
            "├───────┼───────┼───────┼───────┤\n"
            "│CPU 20 │CPU 21 │CPU 22 │CPU 23 │\n"
            "├───────┼───────┼───────┼───────┤\n"
            "│CPU 24 │CPU 25 │CPU 26 │CPU 27 │\n"
            "├───────┼───────┼───────┼───────┤\n"
            "│CPU 28 │CPU 29 │CPU 30 │CPU 31 │\n"
            "└───────┴───────┴───────┴───────┘\n");
}

// JAX tests/debugging_primitives_test.py test_sharding_with_replication (first picture).
TEST(VisualizeSharding, JaxTestReplication32Devices) {
  EXPECT_EQ(picture({8, 8}, {8, 4}, {"x", "y"}, P("x", None),
                    {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                     16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31}),
            "┌───────────────────────┐\n"
            "│      CPU 0,1,2,3      │\n"
            "├───────────────────────┤\n"
            "│      CPU 4,5,6,7      │\n"
            "├───────────────────────┤\n"
            "│     CPU 8,9,10,11     │\n"
            "├───────────────────────┤\n"
            "│    CPU 12,13,14,15    │\n"
            "├───────────────────────┤\n"
            "│    CPU 16,17,18,19    │\n"
            "├───────────────────────┤\n"
            "│    CPU 20,21,22,23    │\n"
            "├───────────────────────┤\n"
            "│    CPU 24,25,26,27    │\n"
            "├───────────────────────┤\n"
            "│    CPU 28,29,30,31    │\n"
            "└───────────────────────┘\n");
}

// JAX tests/debugging_primitives_test.py test_sharding_with_replication (second picture).
TEST(VisualizeSharding, JaxTestReplicationColumns) {
  EXPECT_EQ(picture({8, 8}, {4, 2}, {"x", "y"}, P(None, "y"), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌───────────┬───────────┐\n"
            "│           │           │\n"
            "│           │           │\n"
            "│           │           │\n"
            "│           │           │\n"
            "│CPU 0,2,4,6│CPU 1,3,5,7│\n"
            "│           │           │\n"
            "│           │           │\n"
            "│           │           │\n"
            "│           │           │\n"
            "└───────────┴───────────┘\n");
}

// JAX tests/debugging_primitives_test.py test_visualize_wide_array.
TEST(VisualizeSharding, JaxTestWideArray) {
  EXPECT_EQ(picture({128, 10000}, {8, 4}, {"x", "y"}, P("x", None),
                    {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                     16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31}),
            "┌──────────────────────────────────────────────────────────────────────────────┐\n"
            "│                                 CPU 0,1,2,3                                  │\n"
            "├──────────────────────────────────────────────────────────────────────────────┤\n"
            "│                                 CPU 4,5,6,7                                  │\n"
            "├──────────────────────────────────────────────────────────────────────────────┤\n"
            "│                                CPU 8,9,10,11                                 │\n"
            "├──────────────────────────────────────────────────────────────────────────────┤\n"
            "│                               CPU 12,13,14,15                                │\n"
            "├──────────────────────────────────────────────────────────────────────────────┤\n"
            "│                               CPU 16,17,18,19                                │\n"
            "├──────────────────────────────────────────────────────────────────────────────┤\n"
            "│                               CPU 20,21,22,23                                │\n"
            "├──────────────────────────────────────────────────────────────────────────────┤\n"
            "│                               CPU 24,25,26,27                                │\n"
            "├──────────────────────────────────────────────────────────────────────────────┤\n"
            "│                               CPU 28,29,30,31                                │\n"
            "└──────────────────────────────────────────────────────────────────────────────┘\n");
}

// JAX docs/notebooks/Distributed_arrays_and_automatic_parallelization.ipynb (as of jax-ml/jax a900877d84^, which
// removed it), cell 8, TPU labels read as CPU; its TPU mesh orders devices 0,1,2,3,6,7,4,5.
TEST(VisualizeSharding, Docs8192SquareXY) {
  EXPECT_EQ(picture({8192, 8192}, {4, 2}, {"a", "b"}, P("a", "b"), {0, 1, 2, 3, 6, 7, 4, 5}),
            "┌──────────┬──────────┐\n"
            "│  CPU 0   │  CPU 1   │\n"
            "├──────────┼──────────┤\n"
            "│  CPU 2   │  CPU 3   │\n"
            "├──────────┼──────────┤\n"
            "│  CPU 6   │  CPU 7   │\n"
            "├──────────┼──────────┤\n"
            "│  CPU 4   │  CPU 5   │\n"
            "└──────────┴──────────┘\n");
}

// JAX docs/notebooks/Distributed_arrays_and_automatic_parallelization.ipynb (as of jax-ml/jax a900877d84^, which
// removed it), cell 25, TPU labels read as CPU; its TPU mesh orders devices 0,1,2,3,6,7,4,5.
TEST(VisualizeSharding, Docs8192SquareTransposed) {
  EXPECT_EQ(picture({8192, 8192}, {4, 2}, {"a", "b"}, P("b", "a"), {0, 1, 2, 3, 6, 7, 4, 5}),
            "┌───────┬───────┬───────┬───────┐\n"
            "│       │       │       │       │\n"
            "│ CPU 0 │ CPU 2 │ CPU 6 │ CPU 4 │\n"
            "│       │       │       │       │\n"
            "│       │       │       │       │\n"
            "├───────┼───────┼───────┼───────┤\n"
            "│       │       │       │       │\n"
            "│ CPU 1 │ CPU 3 │ CPU 7 │ CPU 5 │\n"
            "│       │       │       │       │\n"
            "│       │       │       │       │\n"
            "└───────┴───────┴───────┴───────┘\n");
}

// JAX docs/notebooks/Distributed_arrays_and_automatic_parallelization.ipynb (as of jax-ml/jax a900877d84^, which
// removed it), cell 26, TPU labels read as CPU; its TPU mesh orders devices 0,1,2,3,6,7,4,5.
TEST(VisualizeSharding, Docs8192SquareRows) {
  EXPECT_EQ(picture({8192, 8192}, {4, 2}, {"a", "b"}, P("a", None), {0, 1, 2, 3, 6, 7, 4, 5}),
            "┌───────────────────────┐\n"
            "│        CPU 0,1        │\n"
            "├───────────────────────┤\n"
            "│        CPU 2,3        │\n"
            "├───────────────────────┤\n"
            "│        CPU 6,7        │\n"
            "├───────────────────────┤\n"
            "│        CPU 4,5        │\n"
            "└───────────────────────┘\n");
}

// JAX docs/notebooks/Distributed_arrays_and_automatic_parallelization.ipynb (as of jax-ml/jax a900877d84^, which
// removed it), cell 28, TPU labels read as CPU; its TPU mesh orders devices 0,1,2,3,6,7,4,5.
TEST(VisualizeSharding, Docs8192SquareColumnsB) {
  EXPECT_EQ(picture({8192, 8192}, {4, 2}, {"a", "b"}, P(None, "b"), {0, 1, 2, 3, 6, 7, 4, 5}),
            "┌───────────┬───────────┐\n"
            "│           │           │\n"
            "│           │           │\n"
            "│           │           │\n"
            "│           │           │\n"
            "│CPU 0,2,4,6│CPU 1,3,5,7│\n"
            "│           │           │\n"
            "│           │           │\n"
            "│           │           │\n"
            "│           │           │\n"
            "└───────────┴───────────┘\n");
}

// JAX docs/notebooks/Distributed_arrays_and_automatic_parallelization.ipynb (as of jax-ml/jax a900877d84^, which
// removed it), cell 29, TPU labels read as CPU; its TPU mesh orders devices 0,1,2,3,6,7,4,5.
TEST(VisualizeSharding, Docs8192SquareColumnsA) {
  EXPECT_EQ(picture({8192, 8192}, {4, 2}, {"a", "b"}, P(None, "a"), {0, 1, 2, 3, 6, 7, 4, 5}),
            "┌───────┬───────┬───────┬───────┐\n"
            "│       │       │       │       │\n"
            "│       │       │       │       │\n"
            "│       │       │       │       │\n"
            "│       │       │       │       │\n"
            "│CPU 0,1│CPU 2,3│CPU 6,7│CPU 4,5│\n"
            "│       │       │       │       │\n"
            "│       │       │       │       │\n"
            "│       │       │       │       │\n"
            "│       │       │       │       │\n"
            "└───────┴───────┴───────┴───────┘\n");
}

// JAX docs/notebooks/Distributed_arrays_and_automatic_parallelization.ipynb (as of jax-ml/jax a900877d84^, which
// removed it), cell 31, TPU labels read as CPU; its TPU mesh orders devices 0,1,2,3,6,7,4,5.
TEST(VisualizeSharding, Docs8192SquareBothAxesOnRows) {
  EXPECT_EQ(picture({8192, 8192}, {4, 2}, {"a", "b"}, P(Axes{"a", "b"}, None), {0, 1, 2, 3, 6, 7, 4, 5}),
            "┌───────────────────────┐\n"
            "│         CPU 0         │\n"
            "├───────────────────────┤\n"
            "│         CPU 1         │\n"
            "├───────────────────────┤\n"
            "│         CPU 2         │\n"
            "├───────────────────────┤\n"
            "│         CPU 3         │\n"
            "├───────────────────────┤\n"
            "│         CPU 6         │\n"
            "├───────────────────────┤\n"
            "│         CPU 7         │\n"
            "├───────────────────────┤\n"
            "│         CPU 4         │\n"
            "├───────────────────────┤\n"
            "│         CPU 5         │\n"
            "└───────────────────────┘\n");
}

// JAX docs/notebooks/Distributed_arrays_and_automatic_parallelization.ipynb (as of jax-ml/jax a900877d84^, which
// removed it), cell 40, TPU labels read as CPU; its TPU mesh orders devices 0,1,2,3,6,7,4,5.
TEST(VisualizeSharding, Docs8192SingleDevice) {
  EXPECT_EQ(picture({8192, 8192}, {1}, {"a"}, P(), {0}),
            "┌───────────────────────┐\n"
            "│                       │\n"
            "│                       │\n"
            "│                       │\n"
            "│                       │\n"
            "│         CPU 0         │\n"
            "│                       │\n"
            "│                       │\n"
            "│                       │\n"
            "│                       │\n"
            "└───────────────────────┘\n");
}

// JAX docs/multi_process.md, "Arrays and computations can be distributed across hosts" (v5litepod-16 device order), TPU
// read as CPU.
TEST(VisualizeSharding, DocsMultiProcess32x32On16) {
  EXPECT_EQ(picture({32, 32}, {16}, {"a"}, P("a"), {0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15}),
            "┌───────────────────────┐\n"
            "│         CPU 0         │\n"
            "├───────────────────────┤\n"
            "│         CPU 1         │\n"
            "├───────────────────────┤\n"
            "│         CPU 4         │\n"
            "├───────────────────────┤\n"
            "│         CPU 5         │\n"
            "├───────────────────────┤\n"
            "│         CPU 2         │\n"
            "├───────────────────────┤\n"
            "│         CPU 3         │\n"
            "├───────────────────────┤\n"
            "│         CPU 6         │\n"
            "├───────────────────────┤\n"
            "│         CPU 7         │\n"
            "├───────────────────────┤\n"
            "│         CPU 8         │\n"
            "├───────────────────────┤\n"
            "│         CPU 9         │\n"
            "├───────────────────────┤\n"
            "│        CPU 12         │\n"
            "├───────────────────────┤\n"
            "│        CPU 13         │\n"
            "├───────────────────────┤\n"
            "│        CPU 10         │\n"
            "├───────────────────────┤\n"
            "│        CPU 11         │\n"
            "├───────────────────────┤\n"
            "│        CPU 14         │\n"
            "├───────────────────────┤\n"
            "│        CPU 15         │\n"
            "└───────────────────────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case); the (8, 2) array of the
// jax.sharding.Mesh docstring.
TEST(VisualizeSharding, Derived8x2XY) {
  EXPECT_EQ(picture({8, 2}, {4, 2}, {"x", "y"}, P("x", "y"), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌───────┬───────┐\n"
            "│ CPU 0 │ CPU 1 │\n"
            "├───────┼───────┤\n"
            "│ CPU 2 │ CPU 3 │\n"
            "├───────┼───────┤\n"
            "│ CPU 4 │ CPU 5 │\n"
            "├───────┼───────┤\n"
            "│ CPU 6 │ CPU 7 │\n"
            "└───────┴───────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case); the (16, 8) array of
// example_device_put.
TEST(VisualizeSharding, Derived16x8Rows) {
  EXPECT_EQ(picture({16, 8}, {4, 2}, {"data", "model"}, P("data", None), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌──────────┐\n"
            "│ CPU 0,1  │\n"
            "├──────────┤\n"
            "│ CPU 2,3  │\n"
            "├──────────┤\n"
            "│ CPU 4,5  │\n"
            "├──────────┤\n"
            "│ CPU 6,7  │\n"
            "└──────────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case); the (16, 8) array of
// example_device_put.
TEST(VisualizeSharding, Derived16x8Columns) {
  EXPECT_EQ(picture({16, 8}, {4, 2}, {"data", "model"}, P(None, "model"), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌───────────┬───────────┐\n"
            "│           │           │\n"
            "│           │           │\n"
            "│           │           │\n"
            "│           │           │\n"
            "│CPU 0,2,4,6│CPU 1,3,5,7│\n"
            "│           │           │\n"
            "│           │           │\n"
            "│           │           │\n"
            "│           │           │\n"
            "└───────────┴───────────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case); the (16, 8) array of
// example_device_put.
TEST(VisualizeSharding, Derived16x8Grid) {
  EXPECT_EQ(picture({16, 8}, {4, 2}, {"data", "model"}, P("data", "model"), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌───────┬───────┐\n"
            "│ CPU 0 │ CPU 1 │\n"
            "├───────┼───────┤\n"
            "│ CPU 2 │ CPU 3 │\n"
            "├───────┼───────┤\n"
            "│ CPU 4 │ CPU 5 │\n"
            "├───────┼───────┤\n"
            "│ CPU 6 │ CPU 7 │\n"
            "└───────┴───────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case); the (16, 8) array of
// example_device_put.
TEST(VisualizeSharding, Derived16x8BothAxesOnRows) {
  EXPECT_EQ(picture({16, 8}, {4, 2}, {"data", "model"}, P(Axes{"data", "model"}), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌──────────┐\n"
            "│  CPU 0   │\n"
            "├──────────┤\n"
            "│  CPU 1   │\n"
            "├──────────┤\n"
            "│  CPU 2   │\n"
            "├──────────┤\n"
            "│  CPU 3   │\n"
            "├──────────┤\n"
            "│  CPU 4   │\n"
            "├──────────┤\n"
            "│  CPU 5   │\n"
            "├──────────┤\n"
            "│  CPU 6   │\n"
            "├──────────┤\n"
            "│  CPU 7   │\n"
            "└──────────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case); the (16, 8) array of
// example_device_put.
TEST(VisualizeSharding, Derived16x8BothAxesReversed) {
  EXPECT_EQ(picture({16, 8}, {4, 2}, {"data", "model"}, P(Axes{"model", "data"}), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌──────────┐\n"
            "│  CPU 0   │\n"
            "├──────────┤\n"
            "│  CPU 2   │\n"
            "├──────────┤\n"
            "│  CPU 4   │\n"
            "├──────────┤\n"
            "│  CPU 6   │\n"
            "├──────────┤\n"
            "│  CPU 1   │\n"
            "├──────────┤\n"
            "│  CPU 3   │\n"
            "├──────────┤\n"
            "│  CPU 5   │\n"
            "├──────────┤\n"
            "│  CPU 7   │\n"
            "└──────────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case); the (16, 8) array of
// example_device_put.
TEST(VisualizeSharding, Derived16x8Replicated) {
  EXPECT_EQ(picture({16, 8}, {4, 2}, {"data", "model"}, P(), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌───────────────────┐\n"
            "│                   │\n"
            "│                   │\n"
            "│                   │\n"
            "│                   │\n"
            "│CPU 0,1,2,3,4,5,6,7│\n"
            "│                   │\n"
            "│                   │\n"
            "│                   │\n"
            "│                   │\n"
            "└───────────────────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case).
TEST(VisualizeSharding, Derived16x8XYTogetherOn4x2) {
  EXPECT_EQ(picture({16, 8}, {4, 2}, {"x", "y"}, P(Axes{"x", "y"}), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌──────────┐\n"
            "│  CPU 0   │\n"
            "├──────────┤\n"
            "│  CPU 1   │\n"
            "├──────────┤\n"
            "│  CPU 2   │\n"
            "├──────────┤\n"
            "│  CPU 3   │\n"
            "├──────────┤\n"
            "│  CPU 4   │\n"
            "├──────────┤\n"
            "│  CPU 5   │\n"
            "├──────────┤\n"
            "│  CPU 6   │\n"
            "├──────────┤\n"
            "│  CPU 7   │\n"
            "└──────────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case).
TEST(VisualizeSharding, Derived16x8YXOn4x2) {
  EXPECT_EQ(picture({16, 8}, {4, 2}, {"x", "y"}, P("y", "x"), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌───────┬───────┬───────┬───────┐\n"
            "│       │       │       │       │\n"
            "│ CPU 0 │ CPU 2 │ CPU 4 │ CPU 6 │\n"
            "│       │       │       │       │\n"
            "│       │       │       │       │\n"
            "├───────┼───────┼───────┼───────┤\n"
            "│       │       │       │       │\n"
            "│ CPU 1 │ CPU 3 │ CPU 5 │ CPU 7 │\n"
            "│       │       │       │       │\n"
            "│       │       │       │       │\n"
            "└───────┴───────┴───────┴───────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case).
TEST(VisualizeSharding, Derived16x8XYTogetherOn2x4) {
  EXPECT_EQ(picture({16, 8}, {2, 4}, {"x", "y"}, P(Axes{"x", "y"}), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌──────────┐\n"
            "│  CPU 0   │\n"
            "├──────────┤\n"
            "│  CPU 1   │\n"
            "├──────────┤\n"
            "│  CPU 2   │\n"
            "├──────────┤\n"
            "│  CPU 3   │\n"
            "├──────────┤\n"
            "│  CPU 4   │\n"
            "├──────────┤\n"
            "│  CPU 5   │\n"
            "├──────────┤\n"
            "│  CPU 6   │\n"
            "├──────────┤\n"
            "│  CPU 7   │\n"
            "└──────────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case).
TEST(VisualizeSharding, Derived16x8YXOn2x4) {
  EXPECT_EQ(picture({16, 8}, {2, 4}, {"x", "y"}, P("y", "x"), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌───────┬───────┐\n"
            "│ CPU 0 │ CPU 4 │\n"
            "├───────┼───────┤\n"
            "│ CPU 1 │ CPU 5 │\n"
            "├───────┼───────┤\n"
            "│ CPU 2 │ CPU 6 │\n"
            "├───────┼───────┤\n"
            "│ CPU 3 │ CPU 7 │\n"
            "└───────┴───────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case); a 1-D array.
TEST(VisualizeSharding, Derived1DOver8) {
  EXPECT_EQ(picture({8}, {8}, {"x"}, P("x"), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌───────┬───────┬───────┬───────┬───────┬───────┬───────┬───────┐\n"
            "│ CPU 0 │ CPU 1 │ CPU 2 │ CPU 3 │ CPU 4 │ CPU 5 │ CPU 6 │ CPU 7 │\n"
            "└───────┴───────┴───────┴───────┴───────┴───────┴───────┴───────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case); a 1-D array.
TEST(VisualizeSharding, Derived1DXYTogether) {
  EXPECT_EQ(picture({8}, {4, 2}, {"x", "y"}, P(Axes{"x", "y"}), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌───────┬───────┬───────┬───────┬───────┬───────┬───────┬───────┐\n"
            "│ CPU 0 │ CPU 1 │ CPU 2 │ CPU 3 │ CPU 4 │ CPU 5 │ CPU 6 │ CPU 7 │\n"
            "└───────┴───────┴───────┴───────┴───────┴───────┴───────┴───────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case); a 1-D array.
TEST(VisualizeSharding, Derived1DReplicatedOverY) {
  EXPECT_EQ(picture({8}, {4, 2}, {"x", "y"}, P("y"), {0, 1, 2, 3, 4, 5, 6, 7}),
            "┌───────────┬───────────┐\n"
            "│CPU 0,2,4,6│CPU 1,3,5,7│\n"
            "└───────────┴───────────┘\n");
}

// derived from jax/_src/debugging.py visualize_sharding (JAX has no picture of this case); a 1-D array.
TEST(VisualizeSharding, Derived1DLong) {
  EXPECT_EQ(picture({1000}, {2}, {"x"}, P("x"), {0, 1}),
            "┌───────┬───────┐\n"
            "│ CPU 0 │ CPU 1 │\n"
            "└───────┴───────┘\n");
}

// A difference on purpose (docs/guide.md): rich squeezes a table wider than 80 columns into
// it, folding labels and cutting them with an ellipsis ("C…"); Tessera draws it at its natural
// width, every label whole: 16 tiles of 7 columns and 17 rules.
TEST(VisualizeSharding, WiderThanEightyColumnsKeepsEveryLabel) {
  std::vector<int> ids(16);
  for (int i = 0; i < 16; ++i) ids[i] = i;
  const std::string out = picture({16}, {16}, {"x"}, P("x"), ids);
  EXPECT_THAT(out, HasSubstr("│ CPU 0 │ CPU 1 │"));
  EXPECT_THAT(out, HasSubstr("│CPU 15 │\n"));
  EXPECT_EQ(out.substr(0, out.find('\n')).size(), (16 * 7 + 17) * std::string("─").size());
}

TEST(VisualizeSharding, RefusesWhatJaxRefuses) {
  absl::StatusOr<Mesh> mesh = Mesh::create({2}, {"x"}, {0, 1});
  ASSERT_TRUE(mesh.ok());
  absl::StatusOr<std::string> cube = visualize_sharding({2, 2, 2}, NamedSharding(*mesh, P()));
  EXPECT_EQ(cube.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(cube.status().message()), HasSubstr("only 1-D and 2-D arrays"));
  absl::StatusOr<std::string> empty = visualize_sharding({0, 4}, NamedSharding(*mesh, P()));
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(empty.status().message()), HasSubstr("is empty"));
  absl::StatusOr<std::string> uneven = visualize_sharding({3}, NamedSharding(*mesh, P("x")));
  EXPECT_EQ(uneven.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(uneven.status().message()), HasSubstr("not divisible"));
}

}  // namespace
}  // namespace tessera
