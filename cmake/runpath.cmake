# The run path of libroundpipe.so: where the loader finds libtorch and the CUDA runtime the
# library was built against, with no loader cache (ld.so.cache), LD_LIBRARY_PATH or torch import.
#
# libroundpipe needs libtorch's libraries (torch/lib) and, for a CUDA torch, libcudart itself.
# The pip wheel of torch brings its CUDA libraries as other wheels, next to torch in
# site-packages (nvidia/cu13/lib, nvidia/cudnn/lib, ...); libtorch_cuda finds them through its own
# run path ($ORIGIN/../../nvidia/...), but a run path is not inherited, so ours must name them too.
#
# Sets, after find_package(Torch):
#   RP_RUNPATH          absolute folders: torch's lib folder, then every <site-packages>/nvidia/*/lib
#   RP_INSTALL_RUNPATH  what the installed library carries: RP_RUNPATH, and for the Python wheel
#                       (SKBUILD) first the same folders relative to $ORIGIN, since the wheel puts
#                       the library in <site-packages>/roundpipe/, beside torch and nvidia/.
get_filename_component(_rp_torch_prefix "${TORCH_INSTALL_PREFIX}" ABSOLUTE)
get_filename_component(_rp_site_packages "${_rp_torch_prefix}" DIRECTORY)
set(RP_RUNPATH "${_rp_torch_prefix}/lib")
# A libtorch outside site-packages (the C++ zip) has no nvidia/ beside it: the glob is empty.
file(GLOB _rp_cuda_lib_dirs LIST_DIRECTORIES true "${_rp_site_packages}/nvidia/*/lib")
list(SORT _rp_cuda_lib_dirs)
list(APPEND RP_RUNPATH ${_rp_cuda_lib_dirs})

set(RP_INSTALL_RUNPATH ${RP_RUNPATH})
if(SKBUILD)
  get_filename_component(_rp_torch_name "${_rp_torch_prefix}" NAME)
  set(_rp_relative "\$ORIGIN/../${_rp_torch_name}/lib")
  foreach(_rp_dir IN LISTS _rp_cuda_lib_dirs)
    file(RELATIVE_PATH _rp_rel "${_rp_site_packages}" "${_rp_dir}")
    list(APPEND _rp_relative "\$ORIGIN/../${_rp_rel}")
  endforeach()
  set(RP_INSTALL_RUNPATH ${_rp_relative} ${RP_RUNPATH})
endif()
message(STATUS "libroundpipe run path: ${RP_INSTALL_RUNPATH}")
