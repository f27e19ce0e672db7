// 64 KiB of static TLS, for MetricsTlsTest (tests/cli/cli_test.cc): preloaded into a daemon
// (LD_PRELOAD), it takes that much from every thread's stack, as a larger BLAS or another
// library's thread_local data would.
extern "C" {
__attribute__((visibility("default"))) thread_local char tessera_tls_ballast[64 * 1024];
__attribute__((visibility("default"))) char* tessera_tls_ballast_address() { return tessera_tls_ballast; }
}
