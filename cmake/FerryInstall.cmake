# Install rules, the CMake package (find_package(ferry CONFIG) -> ferry::ferry), ferry.pc
# for pkg-config, and CPack's Debian package. Included last by the top-level
# CMakeLists.txt, once every module target exists.
include(CMakePackageConfigHelpers)

get_property(FERRY_INSTALLED_MODULES GLOBAL PROPERTY FERRY_INSTALLED_MODULES)
set(FERRY_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/ferry)

install(TARGETS ${FERRY_INSTALLED_MODULES} ferry_umbrella EXPORT ferryTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/ferry ${PROJECT_BINARY_DIR}/include/ferry
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev FILES_MATCHING PATTERN "*.h")
install(EXPORT ferryTargets NAMESPACE ferry:: DESTINATION ${FERRY_CMAKE_DIR} COMPONENT dev)

# What the exported link interface names, for ferryConfig.cmake's find_dependency calls.
set(FERRY_NEEDS_UCX OFF)
set(FERRY_NEEDS_STORE OFF)
set(FERRY_NEEDS_METRICS OFF)
if(TARGET ferry_transport)
  set(FERRY_NEEDS_UCX ON)
endif()
if(TARGET ferry_store)
  set(FERRY_NEEDS_STORE ON)
endif()
if(TARGET ferry_metrics)
  set(FERRY_NEEDS_METRICS ON)
endif()
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/ferryConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/ferryConfig.cmake INSTALL_DESTINATION ${FERRY_CMAKE_DIR})
# 0.x: a minor version may break the API, so only the same minor version matches.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/ferryConfigVersion.cmake
                                 VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/ferryConfig.cmake ${PROJECT_BINARY_DIR}/ferryConfigVersion.cmake
        DESTINATION ${FERRY_CMAKE_DIR} COMPONENT dev)

# ferry.pc. Libraries in link order (each module depends only on modules defined before
# it, so the reverse of definition order). Static by default: the dependencies go in
# Requires (not .private), so that plain `pkg-config --libs ferry` links.
set(FERRY_PC_LIBS "")
set(FERRY_PC_MODULES ${FERRY_INSTALLED_MODULES})
list(REVERSE FERRY_PC_MODULES)
foreach(m ${FERRY_PC_MODULES})
  string(APPEND FERRY_PC_LIBS " -l${m}")
endforeach()
set(FERRY_PC_DEPS "fmt, nlohmann_json, libxxhash")
if(FERRY_NEEDS_UCX)
  string(APPEND FERRY_PC_DEPS ", ucx, ucx-ucs")
endif()
if(FERRY_NEEDS_STORE)
  string(APPEND FERRY_PC_DEPS ", hiredis, libcrypto")
endif()
if(FERRY_NEEDS_METRICS)
  string(APPEND FERRY_PC_DEPS ", prometheus-cpp-core, prometheus-cpp-pull")
endif()
if(BUILD_SHARED_LIBS)
  set(FERRY_PC_REQUIRES "")
  set(FERRY_PC_REQUIRES_PRIVATE "${FERRY_PC_DEPS}")
else()
  set(FERRY_PC_REQUIRES "${FERRY_PC_DEPS}")
  set(FERRY_PC_REQUIRES_PRIVATE "")
endif()
# Relocatable: the prefix is found from the .pc file's own place (cmake --install --prefix).
file(RELATIVE_PATH FERRY_PC_TO_PREFIX ${CMAKE_INSTALL_FULL_LIBDIR}/pkgconfig ${CMAKE_INSTALL_PREFIX})
string(REGEX REPLACE "/$" "" FERRY_PC_TO_PREFIX "${FERRY_PC_TO_PREFIX}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/ferry.pc.in ${PROJECT_BINARY_DIR}/ferry.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/ferry.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT dev)

# The command (and its MPI broadcast baseline, which `ferry bench` finds beside it) and
# the model configs its sub-commands default to (tools/config_path.h finds them in
# <prefix>/share/ferry/configs from any working directory).
install(TARGETS ferry RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)
if(TARGET ferry-mpi-bcast)
  install(TARGETS ferry-mpi-bcast RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)
endif()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/configs/ DESTINATION ${CMAKE_INSTALL_DATADIR}/ferry/configs
        COMPONENT runtime FILES_MATCHING PATTERN "*.json")
# The emulated hosts of `ferry demo --hosts` (tools/emulated_hosts.h finds it there).
install(PROGRAMS ${PROJECT_SOURCE_DIR}/scripts/hosts.sh DESTINATION ${CMAKE_INSTALL_DATADIR}/ferry/scripts
        COMPONENT runtime)

include(${PROJECT_SOURCE_DIR}/cmake/FerryCPack.cmake)
