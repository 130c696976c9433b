/* kernels_avxvnni.c — the AVX2 kernel table again, with AVX-VNNI integer dot products.
 *
 * Compiled with -mavx2 -mfma -mf16c -mavxvnni (CMakeLists.txt) and chosen by dispatch.c only on
 * CPUs that report AVX-VNNI (Alder Lake and later, Zen 5). The code is kernels_avx2.inc's: with
 * CF_ISA_VNNI set, each u8 x s8 block dot is one vpdpbusd instead of vpmaddubsw + vpmaddwd, so
 * both tables compute the same integer sums and the same float results.
 */
#define CF_ISA_VNNI 1
#include "kernels_avx2.inc"
