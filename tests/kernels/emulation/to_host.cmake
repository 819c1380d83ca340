# cmake -DIN=<kernel.cu> -DOUT=<kernel.cpp> -P to_host.cmake: rewrites a CUDA source for the
# emulation test (see cuda_runtime.h here): launches `k<...><<<cfg>>>(` become
# `emu_launch(cfg, k<...>, ` and the dynamic shared tile becomes a per-block buffer.
file(READ "${IN}" src)
string(REGEX REPLACE "([A-Za-z_][A-Za-z0-9_:]*<[^<>;]*>)[ \t\r\n]*<<<([^>]*)>>>\\("
       "emu_launch(\\2, \\1, " src "${src}")
string(REPLACE "extern __shared__ float tile[];" "float *tile = emu_dynamic_shared();" src
       "${src}")
if(src MATCHES "<<<")
  message(FATAL_ERROR "${IN}: a kernel launch to_host.cmake cannot rewrite")
endif()
file(WRITE "${OUT}" "${src}")
