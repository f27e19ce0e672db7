// bench_mpi_collectives: the reference side of bench_collectives — the same collectives and
// sizes with Open MPI, one JSON line per op and size from rank 0. Run under mpirun.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) out.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

double bus_factor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter" || op == "all_to_all") return double(n - 1) / n;
  return 1.0;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  std::string ops = "all_reduce", bytes_list = "4096";
  int iters = 10;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--ops=", 0) == 0) ops = a.substr(6);
    if (a.rfind("--bytes=", 0) == 0) bytes_list = a.substr(8);
    if (a.rfind("--iters=", 0) == 0) iters = std::max(1, std::atoi(a.c_str() + 8));
  }
  for (const std::string& op : split(ops)) {
    for (const std::string& b : split(bytes_list)) {
      const long long bytes = std::atoll(b.c_str());
      const long long elems = std::max<long long>(bytes / 4, n) / n * n;
      std::vector<float> in(elems, 1.0f), out(elems, 0.0f);
      const int block = static_cast<int>(elems / n);
      std::vector<double> times;
      for (int it = 0; it < iters + 1; ++it) {
        MPI_Barrier(MPI_COMM_WORLD);
        const double start = MPI_Wtime();
        if (op == "all_reduce") {
          MPI_Allreduce(in.data(), out.data(), static_cast<int>(elems), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        } else if (op == "all_gather") {
          MPI_Allgather(in.data(), block, MPI_FLOAT, out.data(), block, MPI_FLOAT, MPI_COMM_WORLD);
        } else if (op == "reduce_scatter") {
          MPI_Reduce_scatter_block(in.data(), out.data(), block, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        } else if (op == "all_to_all") {
          MPI_Alltoall(in.data(), block, MPI_FLOAT, out.data(), block, MPI_FLOAT, MPI_COMM_WORLD);
        } else if (op == "collective_permute") {
          MPI_Sendrecv(in.data(), static_cast<int>(elems), MPI_FLOAT, (rank + 1) % n, 0, out.data(),
                       static_cast<int>(elems), MPI_FLOAT, (rank + n - 1) % n, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        } else {
          MPI_Bcast(in.data(), static_cast<int>(elems), MPI_FLOAT, 0, MPI_COMM_WORLD);
        }
        double t = MPI_Wtime() - start, slowest = 0;
        MPI_Reduce(&t, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (it > 0) times.push_back(slowest);
      }
      if (rank == 0) {
        std::sort(times.begin(), times.end());
        const double t = times[times.size() / 2];
        std::printf("{\"op\": \"%s\", \"bytes\": %lld, \"seconds\": %.9f, \"busbw_gbps\": %.4f}\n", op.c_str(), bytes,
                    t, double(bytes) * bus_factor(op, n) / t / 1e9);
        std::fflush(stdout);
      }
    }
  }
  MPI_Finalize();
  return 0;
}
