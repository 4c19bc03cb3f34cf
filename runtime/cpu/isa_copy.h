// Included first by the kernel files compiled once per instruction set
// (runtime/cpu/kernels_cpu.h): each copy's definitions go into
// tessera::cpu::TS_CPU_ISA, which meson.build sets with the copy's flags.
#pragma once

#if !defined(TS_CPU_ISA)
#error "runtime/cpu kernel files are built per instruction set: meson.build defines TS_CPU_ISA"
#endif
