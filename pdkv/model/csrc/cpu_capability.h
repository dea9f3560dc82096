// ATen's Vectorized<float> (and Sleef's vector exp) for the ISA a pdkv op file is compiled for
// (-march=native): the same vector code ATen's own kernels run on this CPU. Include before any
// ATen header. Part of the extension's build key (pdkv/model/paged_decode_build.py).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif
