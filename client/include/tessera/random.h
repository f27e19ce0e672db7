// tessera::random — JAX's random numbers (jax.random with the default threefry2x32
// implementation and jax_threefry_partitionable, JAX's default since 0.5.0), generated on the
// devices. A key is JAX's raw key, a uint32[2] Value (jax.random.PRNGKey); every function is
// traced from ops, so it runs inside jit under any sharding, and a sharded sample is made
// where it lives: each device hashes only its own elements' counters (no communication), and
// every bit equals the unsharded result's.
//
//   Value k = random::key(42);                                 // PRNGKey(42): [0, 42]
//   Value ks = random::split(k, 3);                            // uint32[3, 2]
//   Value w = random::uniform(random::key_at(ks, 0), {784, 512});
//   Value x = with_sharding_constraint(random::uniform(k, {1024, 1024}), s);   // made in place
//
// Values match JAX's bit for bit where JAX computes exactly (keys, split, fold_in, bits,
// uniform); samplers built on transcendental functions (normal, truncated_normal, categorical)
// agree with JAX to float rounding.
#ifndef TESSERA_RANDOM_H_
#define TESSERA_RANDOM_H_

#include <cstdint>

#include "tessera/trace.h"

namespace tessera::random {

// jax.random.PRNGKey(seed) for a 64-bit seed: [seed >> 32, seed & 0xFFFFFFFF] as uint32 (JAX's
// threefry_seed, "effectively bit-casting" the seed; with jax_enable_x64 off JAX first makes a
// Python int an int32, so its negative seeds differ: key(-1) is [0xFFFFFFFF, 0xFFFFFFFF] here
// and in JAX with x64, [0, 0xFFFFFFFF] in JAX without).
Value key(int64_t seed);
// The key of a traced integer scalar seed: int32 and uint32 seeds are padded with a zero high
// word, int64 ones bit-cast (threefry_seed).
Value key(const Value& seed);
// jax.random.split: `num` new keys (uint32[num, 2]), or an array of them of `shape`
// (uint32[shape + (2,)]); key i is threefry2x32(key, (0, i)) (JAX's _threefry_split_foldlike).
Value split(const Value& key, int64_t num = 2);
Value split(const Value& key, Shape shape);
// jax.random.fold_in: the key threefry2x32(key, (0, uint32(data))) for an integer scalar
// `data` (converted to uint32 as jnp.asarray(data, 'uint32')); fold_in(k, i) == split(k, n)[i].
Value fold_in(const Value& key, const Value& data);
Value fold_in(const Value& key, int64_t data);
// Key i of a uint32[n, 2] array of keys (split's result), as uint32[2].
Value key_at(const Value& keys, int64_t i);

// jax.random.bits with dtype uint32: element i (row-major) is the xor of the two words of
// threefry2x32(key, (i >> 32, i & 0xFFFFFFFF)).
Value bits(const Value& key, Shape shape = {});
// jax.random.uniform in [minval, maxval): the top mantissa bits of bits() as a float in [1, 2),
// minus 1, times (maxval - minval), plus minval, at least minval. dtype float32 or float64 (whose
// 52 mantissa bits come from both words, as JAX's 64-bit bits with jax_enable_x64).
Value uniform(const Value& key, Shape shape = {}, DType dtype = DType::kF32, double minval = 0.0, double maxval = 1.0);

// jax.random.normal: sqrt(2) * erf_inv(uniform(key, shape, dtype, nextafter(-1, 0), 1)).
Value normal(const Value& key, Shape shape = {}, DType dtype = DType::kF32);
// jax.random.truncated_normal on (lower, upper): sqrt(2) * erf_inv(u) for u uniform in
// [erf(lower / sqrt(2)), erf(upper / sqrt(2))), clipped to the open interval.
Value truncated_normal(const Value& key, double lower, double upper, Shape shape = {}, DType dtype = DType::kF32);
// jax.random.bernoulli (its default mode 'low'): uniform(key, shape, dtype(p)) < p, bool. A
// double p is weakly typed, so compares in float32, as a Python float in JAX.
Value bernoulli(const Value& key, double p = 0.5, Shape shape = {});
Value bernoulli(const Value& key, const Value& p, Shape shape);
// jax.random.categorical (replace=True, shape None, gumbel mode 'low'): the argmax along
// `axis` of logits + -log(-log(uniform(key, logits.shape, minval=tiny))), int32.
Value categorical(const Value& key, const Value& logits, int64_t axis = -1);

}  // namespace tessera::random

#endif  // TESSERA_RANDOM_H_
