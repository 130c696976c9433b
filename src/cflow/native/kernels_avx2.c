/* kernels_avx2.c — the AVX2 kernel table: kernels_avx2.inc compiled with -mavx2 -mfma -mf16c
 * (CMakeLists.txt). The code lives in the .inc so that kernels_avxvnni.c can compile the same
 * source with AVX-VNNI dot products; this unit adds nothing of its own. */
#include "kernels_avx2.inc"
