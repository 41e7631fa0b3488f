# config.json parsing and the trainer/inference layout strings.
if(TARGET ferry_models AND TARGET ferry_source)
  ferry_fuzz(fuzz_config_layout SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/config_layout_fuzz.cpp DEPS ferry_models ferry_source)
endif()
