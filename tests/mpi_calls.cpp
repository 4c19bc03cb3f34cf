#include "tests/mpi_calls.h"

#include <mpi.h>

#include <atomic>

namespace {
std::atomic<int64_t> g_calls{0};
}

namespace tessera::testing {
int64_t mpi_calls_made() { return g_calls.load(); }
}  // namespace tessera::testing

// Every communicating or communicator-building MPI function Tessera calls
// (grep -o 'MPI_[A-Z][a-z_]*(' over runtime/ dtensor/ fsdp/ nn/ tools/).
extern "C" {
int MPI_Isend(const void* buf, int count, MPI_Datatype type, int dest, int tag, MPI_Comm comm, MPI_Request* req) {
  g_calls++;
  return PMPI_Isend(buf, count, type, dest, tag, comm, req);
}
int MPI_Irecv(void* buf, int count, MPI_Datatype type, int source, int tag, MPI_Comm comm, MPI_Request* req) {
  g_calls++;
  return PMPI_Irecv(buf, count, type, source, tag, comm, req);
}
int MPI_Iallreduce(const void* send, void* recv, int count, MPI_Datatype type, MPI_Op op, MPI_Comm comm,
                   MPI_Request* req) {
  g_calls++;
  return PMPI_Iallreduce(send, recv, count, type, op, comm, req);
}
int MPI_Iallgather(const void* send, int scount, MPI_Datatype stype, void* recv, int rcount, MPI_Datatype rtype,
                   MPI_Comm comm, MPI_Request* req) {
  g_calls++;
  return PMPI_Iallgather(send, scount, stype, recv, rcount, rtype, comm, req);
}
int MPI_Allgather(const void* send, int scount, MPI_Datatype stype, void* recv, int rcount, MPI_Datatype rtype,
                  MPI_Comm comm) {
  g_calls++;
  return PMPI_Allgather(send, scount, stype, recv, rcount, rtype, comm);
}
int MPI_Ibcast(void* buf, int count, MPI_Datatype type, int root, MPI_Comm comm, MPI_Request* req) {
  g_calls++;
  return PMPI_Ibcast(buf, count, type, root, comm, req);
}
int MPI_Ibarrier(MPI_Comm comm, MPI_Request* req) {
  g_calls++;
  return PMPI_Ibarrier(comm, req);
}
int MPI_Comm_dup(MPI_Comm comm, MPI_Comm* out) {
  g_calls++;
  return PMPI_Comm_dup(comm, out);
}
int MPI_Comm_split(MPI_Comm comm, int color, int key, MPI_Comm* out) {
  g_calls++;
  return PMPI_Comm_split(comm, color, key, out);
}
}
