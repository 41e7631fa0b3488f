// The broadcast baseline of bench/multihost.sh: OpenMPI's MPI_Bcast of BYTES from rank 0
// to every other rank, across emulated hosts (the ranks placed by the script's mpirun).
// Raw bytes only: no gather before and no shard copy-out after, so it is the most a
// broadcast design could do on these links. Prints the seconds of each of TRIALS trials
// (barrier to barrier) on rank 0. Built by the script with mpicxx (not part of the build).
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : size_t(1) << 28;
  const int trials = argc > 2 ? std::atoi(argv[2]) : 3;
  std::vector<char> buf(bytes, static_cast<char>(rank));
  const size_t chunk = size_t(1) << 30;  // MPI counts are int
  for (int t = 0; t < trials; ++t) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = std::chrono::steady_clock::now();
    for (size_t at = 0; at < bytes; at += chunk) {
      const size_t n = bytes - at < chunk ? bytes - at : chunk;
      MPI_Bcast(buf.data() + at, static_cast<int>(n), MPI_CHAR, 0, MPI_COMM_WORLD);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rank == 0) std::printf("mpi_bcast: %zu bytes to %d ranks: %.3f s\n", bytes, size - 1, s);
  }
  MPI_Finalize();
  return 0;
}
