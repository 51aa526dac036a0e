# tools/plan/: the performance model behind `xirang plan` (a library, so
# that tests/tools can test it without the command line).
file(GLOB plan_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/plan/*.cc)
add_library(xirang_plan STATIC ${plan_sources})
target_compile_options(xirang_plan PRIVATE ${XIRANG_WARNINGS})
target_include_directories(xirang_plan PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(xirang_plan PUBLIC xirang_runtime yaml-cpp nlohmann_json::nlohmann_json)
target_link_libraries(xirang PRIVATE xirang_plan)
