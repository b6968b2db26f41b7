# Per-source CUDA architectures from a `_smXX` file-name suffix.
#
# fastawq_set_source_archs(<archs> <sources...>): <archs> is a list like "8.0;9.0a". A source
# named *_sm90.cu is compiled for the listed archs >= 9.0, *_sm80.cu for those >= 8.0, any other
# .cu for all of them. Sets FASTAWQ_SKIPPED_SOURCES to the sources no listed arch can take, so the
# caller can leave them out (and define FASTAWQ_NO_<FAMILY> for the registration).

function(_fastawq_arch_number arch out)
  string(REGEX REPLACE "[af]$" "" num "${arch}")
  string(REPLACE "." "" num "${num}")
  set(${out} "${num}" PARENT_SCOPE)
endfunction()

# "9.0a" -> "-gencode=arch=compute_90a,code=sm_90a" (the -gencode form: `-arch=sm_90a` also runs
# a plain sm_90 pass in some nvcc versions, which rejects wgmma).
function(_fastawq_gencode arch out)
  string(REGEX MATCH "[af]$" suffix "${arch}")
  _fastawq_arch_number("${arch}" num)
  set(${out} "-gencode=arch=compute_${num}${suffix},code=sm_${num}${suffix}" PARENT_SCOPE)
endfunction()

function(fastawq_set_source_archs archs)
  set(skipped "")
  foreach(src IN LISTS ARGN)
    get_filename_component(name "${src}" NAME_WE)
    set(min 0)
    if(name MATCHES "_sm([0-9]+)$")
      set(min "${CMAKE_MATCH_1}")
    endif()
    set(flags "")
    foreach(arch IN LISTS archs)
      _fastawq_arch_number("${arch}" num)
      if(num GREATER_EQUAL min)
        _fastawq_gencode("${arch}" gc)
        list(APPEND flags "${gc}")
      endif()
    endforeach()
    if(flags)
      set_source_files_properties("${src}" PROPERTIES COMPILE_OPTIONS "${flags}")
    else()
      list(APPEND skipped "${src}")
    endif()
  endforeach()
  set(FASTAWQ_SKIPPED_SOURCES "${skipped}" PARENT_SCOPE)
endfunction()
