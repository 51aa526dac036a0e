# xirang_library(NAME FOLDER SOURCES... [LAYERS allowed folders...] [LINK libs...])
#
# Declares one folder's library target. LAYERS lists the project folders whose
# headers the folder may include; every other project folder is forbidden, and
# a build step (cmake/check_layers.cmake) fails the target when a source or
# header of the folder includes one. The target links the allowed layers'
# targets, so the include rules and the link graph are the same list.
set(XIRANG_ALL_LAYERS core kernels comm models runtime tools)

function(xirang_check_layers target folder)
  set(allowed ${folder} ${ARGN})
  set(forbidden ${XIRANG_ALL_LAYERS})
  list(REMOVE_ITEM forbidden ${allowed})
  file(GLOB_RECURSE files CONFIGURE_DEPENDS
       ${PROJECT_SOURCE_DIR}/${folder}/*.h ${PROJECT_SOURCE_DIR}/${folder}/*.cc
       ${PROJECT_SOURCE_DIR}/${folder}/*.cu ${PROJECT_SOURCE_DIR}/${folder}/*.cuh)
  set(stamp ${CMAKE_CURRENT_BINARY_DIR}/${target}.layers.stamp)
  string(REPLACE ";" "," forbidden_csv "${forbidden}")
  add_custom_command(
    OUTPUT ${stamp}
    COMMAND ${CMAKE_COMMAND} -DFOLDER=${folder} -DFORBIDDEN=${forbidden_csv}
            -DROOT=${PROJECT_SOURCE_DIR} -DSTAMP=${stamp}
            -P ${PROJECT_SOURCE_DIR}/cmake/check_layers.cmake
    DEPENDS ${files} ${PROJECT_SOURCE_DIR}/cmake/check_layers.cmake
    COMMENT "Checking the include layers of ${folder}/")
  add_custom_target(${target}_layers DEPENDS ${stamp})
  add_dependencies(${target} ${target}_layers)
endfunction()

function(xirang_library name folder)
  cmake_parse_arguments(X "" "" "SOURCES;LAYERS;LINK" ${ARGN})
  add_library(${name} STATIC ${X_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${XIRANG_WARNINGS} ${XIRANG_ARCH_FLAGS}>)
  foreach(layer ${X_LAYERS})
    target_link_libraries(${name} PUBLIC xirang_${layer})
  endforeach()
  if(X_LINK)
    target_link_libraries(${name} PUBLIC ${X_LINK})
  endif()
  xirang_check_layers(${name} ${folder} ${X_LAYERS})
endfunction()
