// Prints the communication schedules of csrc/include/flux_shmem/comm_schedule.cuh for the CPU tests.
//   schedule_dump ag <world> <node_size> <chunks>            -> "pe kind src dest chunk" per unit of every PE
//   schedule_dump rs <world> <node_size> <Ms> <unit_rows>    -> "pe phase seg u lo hi" per unit of every PE
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include "flux_shmem/comm_schedule.cuh"

int main(int argc, char** argv) {
  if (argc < 5) return 2;
  const int world = atoi(argv[2]), L = atoi(argv[3]);
  if (!strcmp(argv[1], "ag")) {
    const int chunks = atoi(argv[4]);
    for (int pe = 0; pe < world; ++pe) {
      fs::Topo t{pe, world, L};
      for (int u = 0; u < fs::ag_num_units(t, chunks); ++u) {
        fs::AgUnit w = fs::ag_unit(t, chunks, u);
        printf("%d %d %d %d %d\n", pe, w.kind, w.src, w.dest, w.chunk);
      }
    }
    return 0;
  }
  if (!strcmp(argv[1], "rs") && argc >= 6) {
    const long long Ms = atoll(argv[4]);
    const int ur = atoi(argv[5]);
    for (int pe = 0; pe < world; ++pe) {
      fs::Topo t{pe, world, L};
      for (int i = 0; i < fs::rs_num_units(t, Ms, ur); ++i) {
        fs::RsUnit w = fs::rs_unit(t, Ms, ur, i);
        int64_t lo, hi;
        fs::rs_unit_rows(Ms, ur, w.seg, w.u, &lo, &hi);
        printf("%d %d %d %d %lld %lld\n", pe, w.phase, w.seg, w.u, (long long)lo, (long long)hi);
      }
    }
    return 0;
  }
  return 2;
}
