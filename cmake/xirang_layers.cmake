# xirang_library(NAME FOLDER SOURCES... [LAYERS allowed folders...] [LINK libs...])
#
# Declares one layer's library target. A layer is a folder (core, kernels,
# comm, models, runtime) or a wing of one (runtime/data, runtime/config,
# runtime/checkpoint, runtime/step, runtime/observe, runtime/resilience): a wing's files belong to the wing, not to the folder
# above it. LAYERS lists the layers whose headers the layer may include;
# every other project layer is forbidden, and a build step
# (cmake/check_layers.cmake) fails the target when one of its sources or
# headers includes one. The target links the allowed layers' targets, so the
# include rules and the link graph are the same list.
set(XIRANG_ALL_LAYERS core kernels comm models runtime/data runtime/config runtime/checkpoint runtime/step
    runtime/observe runtime/resilience runtime analysis tools)

# The library target of a layer: xirang_<last path component> ("runtime/data" -> xirang_data).
function(xirang_layer_target layer out)
  get_filename_component(leaf ${layer} NAME)
  set(${out} xirang_${leaf} PARENT_SCOPE)
endfunction()

function(xirang_check_layers target folder)
  set(allowed ${folder} ${ARGN})
  set(forbidden ${XIRANG_ALL_LAYERS})
  list(REMOVE_ITEM forbidden ${allowed})
  file(GLOB_RECURSE files CONFIGURE_DEPENDS
       ${PROJECT_SOURCE_DIR}/${folder}/*.h ${PROJECT_SOURCE_DIR}/${folder}/*.cc
       ${PROJECT_SOURCE_DIR}/${folder}/*.cu ${PROJECT_SOURCE_DIR}/${folder}/*.cuh)
  set(stamp ${CMAKE_CURRENT_BINARY_DIR}/${target}.layers.stamp)
  string(REPLACE ";" "," forbidden_csv "${forbidden}")
  string(REPLACE ";" "," all_csv "${XIRANG_ALL_LAYERS}")
  add_custom_command(
    OUTPUT ${stamp}
    COMMAND ${CMAKE_COMMAND} -DFOLDER=${folder} -DFORBIDDEN=${forbidden_csv} -DLAYERS=${all_csv}
            -DROOT=${PROJECT_SOURCE_DIR} -DSTAMP=${stamp}
            -P ${PROJECT_SOURCE_DIR}/cmake/check_layers.cmake
    DEPENDS ${files} ${PROJECT_SOURCE_DIR}/cmake/check_layers.cmake
    COMMENT "Checking the include layers of ${folder}/")
  string(REPLACE "/" "_" stamp_target ${target})
  add_custom_target(${stamp_target}_layers DEPENDS ${stamp})
  add_dependencies(${target} ${stamp_target}_layers)
endfunction()

function(xirang_library name folder)
  cmake_parse_arguments(X "" "" "SOURCES;LAYERS;LINK" ${ARGN})
  add_library(${name} STATIC ${X_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${XIRANG_WARNINGS} ${XIRANG_ARCH_FLAGS}>)
  foreach(layer ${X_LAYERS})
    xirang_layer_target(${layer} dep)
    target_link_libraries(${name} PUBLIC ${dep})
  endforeach()
  if(X_LINK)
    target_link_libraries(${name} PUBLIC ${X_LINK})
  endif()
  xirang_check_layers(${name} ${folder} ${X_LAYERS})
endfunction()
