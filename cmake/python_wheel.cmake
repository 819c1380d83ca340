# The Python wheel's build (pip install ./bindings/python, through scikit-build-core, which sets
# SKBUILD): build against the torch of the environment the wheel is for.
#
# pip builds in an isolated environment: it hides the target environment's site-packages from
# the build through PYTHONPATH (a sitecustomize), so `import torch` fails there. The interpreter
# is the target environment's own, though: run with -E (PYTHON* variables ignored) it sees its
# site-packages again, and with them the torch the wheel will run with. The wheel's requirement
# pins the same torch (bindings/python/_build/torch_pin.py asks the same way).
if(NOT Python_EXECUTABLE)
  find_package(Python COMPONENTS Interpreter REQUIRED)
endif()
execute_process(
  COMMAND "${Python_EXECUTABLE}" -E -c
          "import torch; print(torch.utils.cmake_prefix_path); print(torch.__version__)"
  OUTPUT_VARIABLE _rp_torch_info OUTPUT_STRIP_TRAILING_WHITESPACE
  ERROR_VARIABLE _rp_torch_error RESULT_VARIABLE _rp_torch_rc)
if(NOT _rp_torch_rc EQUAL 0)
  message(FATAL_ERROR "RoundPipe's wheel is built against the torch of the environment it is "
    "installed into, and ${Python_EXECUTABLE} cannot import torch: install torch first "
    "(pip install torch), then RoundPipe.\n${_rp_torch_error}")
endif()
string(REPLACE "\n" ";" _rp_torch_info "${_rp_torch_info}")
list(GET _rp_torch_info 0 _rp_torch_cmake_prefix)
list(GET _rp_torch_info 1 _rp_torch_version)
message(STATUS "RoundPipe wheel: building against torch ${_rp_torch_version} "
  "(${_rp_torch_cmake_prefix})")
list(PREPEND CMAKE_PREFIX_PATH "${_rp_torch_cmake_prefix}")
