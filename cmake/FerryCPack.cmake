# CPack: two Debian packages from one build (`cpack -G DEB` in the build directory):
#   ferry      the command, its MPI baseline, the model configs (and the shared
#              libraries with BUILD_SHARED_LIBS=ON); dependencies from dpkg-shlibdeps.
#   ferry-dev  headers, static libraries, the CMake package and ferry.pc; depends on
#              ferry and on the -dev packages the exported link interface needs.
# Installed with `apt-get install ./ferry_*.deb ./ferry-dev_*.deb`.
set(CPACK_PACKAGE_NAME ferry)
set(CPACK_PACKAGE_VENDOR ferry)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "Moves model weights from RL trainer ranks to inference ranks")
set(CPACK_PACKAGE_CONTACT "ferry maintainers <ferry@localhost>")
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_STRIP_FILES ON)
set(CPACK_COMPONENTS_ALL runtime dev)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME ferry)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SHLIBDEPS ON)
# `ferry bench` runs its broadcast baseline (ferry-mpi-bcast) under mpirun.
set(CPACK_DEBIAN_RUNTIME_PACKAGE_RECOMMENDS "openmpi-bin")
set(CPACK_DEBIAN_DEV_PACKAGE_NAME ferry-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS
    "ferry (= ${PROJECT_VERSION}), libfmt-dev, nlohmann-json3-dev, libxxhash-dev, libucx-dev, libhiredis-dev, libssl-dev, prometheus-cpp-dev, pkg-config")
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
include(CPack)
