// Which BLAS kernel this process computes dot_general with, and whether the CPU could run a
// faster one.
//
// OpenBLAS picks its kernel once, when the library loads (before main), from the CPU id or from
// the OPENBLAS_CORETYPE environment variable. 0.3.21 does not recognise recent AVX-512 Xeons and
// falls back to its generic "Prescott" kernel, 4-5x slower for sgemm. Nothing a running process
// does changes the choice, so the fix belongs to whoever launches the worker: set
// OPENBLAS_CORETYPE=SkylakeX in the worker's environment before exec when cpu_supports_avx512()
// and the variable is unset. Within the worker these report what happened:
//
//   if (cpu_supports_avx512() && blas_kernel_name() == "Prescott") {
//     std::cerr << "worker: OpenBLAS runs its generic kernel; set OPENBLAS_CORETYPE=SkylakeX\n";
//   }
#ifndef TESSERA_WORKER_KERNELS_BLAS_H_
#define TESSERA_WORKER_KERNELS_BLAS_H_

#include <string>

namespace tessera {

// The name of the kernel OpenBLAS loaded ("Prescott", "SkylakeX", "Haswell", ...), as
// openblas_get_corename() reports it.
std::string blas_kernel_name();

// Whether the CPU has AVX-512F, which OpenBLAS's SkylakeX kernel needs.
bool cpu_supports_avx512();

// OpenBLAS 0.3.21 does not recognise recent AVX-512 CPUs and falls back to a generic kernel
// 4-5x slower; it reads OPENBLAS_CORETYPE only when it loads, before main(). Call first thing
// in main(): when the CPU has AVX-512 and nobody chose a kernel, sets it to SkylakeX and
// re-execs the process (returns only if it need not, or the exec failed).
void ensure_fast_blas(char** argv);

// Several devices computing in one process (Client::local) share its OpenBLAS: with its
// default of a thread per core each, n devices on c cores run n*c spinning threads, and a
// sharded step measured 1.5-1.8x slower than with one thread each. Gives each of `devices`
// max(1, cores / devices) threads, unless OPENBLAS_NUM_THREADS chose already.
void share_blas_threads(int devices);

}  // namespace tessera

#endif  // TESSERA_WORKER_KERNELS_BLAS_H_
