// Counts the MPI calls that move data or build communicators, made by any code
// in the test binary (Tessera included), through the MPI profiling interface:
// tests/mpi_calls.cpp defines MPI_Isend, MPI_Comm_split, ... which count and
// forward to PMPI_*. Used to prove that a world of one rank talks to nobody.
#pragma once
#include <cstdint>

namespace tessera::testing {
int64_t mpi_calls_made();
}
