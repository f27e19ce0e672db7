#include "worker/kernels/blas.h"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

namespace tessera {

std::string blas_kernel_name() {
  const char* name = openblas_get_corename();
  return name == nullptr ? std::string() : std::string(name);
}

bool cpu_supports_avx512() { return __builtin_cpu_supports("avx512f"); }

void share_blas_threads(int devices) {
  if (std::getenv("OPENBLAS_NUM_THREADS") != nullptr || devices < 1) return;
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  openblas_set_num_threads(static_cast<int>(std::max<long>(1, cores / devices)));
}

void ensure_fast_blas(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr || !cpu_supports_avx512()) return;
  setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
  execv("/proc/self/exe", argv);
}

}  // namespace tessera
