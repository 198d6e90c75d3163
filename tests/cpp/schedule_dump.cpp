// Prints the C++ side of the schedules (csrc/include/flux_shmem/comm_schedule.cuh) for the CPU tests, which
// compare it with the Python plans (flux_shmem/ops/_schedule.py):
//   schedule_dump rs_rows <Ms> <unit_rows> <seg> <units>  -> "u lo hi" per unit of segment seg
//   schedule_dump chunks <shard_bytes> <chunk_bytes> <n>  -> "c begin size" per chunk
//   schedule_dump rs_unit <Ms> <unit_rows> <n> <tile_n> <group_tiles> <seg> <units>
//                                                          -> "u lo hi c0 c1 slot" per unit of segment seg
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include "flux_shmem/comm_schedule.cuh"

int main(int argc, char** argv) {
  if (argc == 6 && !strcmp(argv[1], "rs_rows")) {
    const long long Ms = atoll(argv[2]);
    const int ur = atoi(argv[3]), seg = atoi(argv[4]), units = atoi(argv[5]);
    for (int u = 0; u < units; ++u) {
      int64_t lo, hi;
      fs::rs_unit_rows(Ms, ur, seg, u, &lo, &hi);
      printf("%d %lld %lld\n", u, (long long)lo, (long long)hi);
    }
    return 0;
  }
  if (argc == 9 && !strcmp(argv[1], "rs_unit")) {
    const long long Ms = atoll(argv[2]), n = atoll(argv[4]);
    const int ur = atoi(argv[3]), tn = atoi(argv[5]), gt = atoi(argv[6]), seg = atoi(argv[7]), units = atoi(argv[8]);
    for (int u = 0; u < units; ++u) {
      const fs::RsRect r = fs::rs_unit(Ms, ur, n, tn, gt, seg, u);
      printf("%d %lld %lld %lld %lld %lld\n", u, (long long)r.lo, (long long)r.hi, (long long)r.c0, (long long)r.c1,
             (long long)r.slot);
    }
    return 0;
  }
  if (argc == 5 && !strcmp(argv[1], "chunks")) {
    const unsigned long long shard = strtoull(argv[2], nullptr, 10), chunk = strtoull(argv[3], nullptr, 10);
    for (int c = 0; c < atoi(argv[4]); ++c)
      printf("%d %llu %llu\n", c, (unsigned long long)fs::chunk_begin(chunk, c),
             (unsigned long long)fs::chunk_size(shard, chunk, c));
    return 0;
  }
  return 2;
}
