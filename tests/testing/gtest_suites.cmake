# One CTest test per GoogleTest suite of a test binary, discovered when ctest
# runs (tests/CMakeLists.txt, knapserve_test_binary, includes this from the
# binary folder's CTestTestfile through a generated file that sets the
# variables below).
#
# Why per suite and not per test: every test process pays ~0.7 s of
# start-up (loading LibTorch and registering its operators) before its first
# test; with one process per test that was most of the suite's time on two
# cores. A suite's tests share a process, as they do when the binary is run
# by hand; ctest -j still runs suites side by side, longest first.
#
# A suite whose every test skipped (GTEST_SKIP, e.g. ../shared missing) is
# reported as skipped: tests/test_main.cc prints "knapserve tests: every test
# skipped" only when no test of the run passed or failed.
#
# Inputs: KNAPSERVE_TEST_BINARY (the executable), KNAPSERVE_TESTS_FILE (where
# the add_test lines are cached; rewritten when the binary is newer),
# KNAPSERVE_TEST_WORKDIR, KNAPSERVE_TEST_TIMEOUT (seconds per suite).

get_filename_component(_knapserve_binary_name "${KNAPSERVE_TEST_BINARY}" NAME)
if(NOT EXISTS "${KNAPSERVE_TEST_BINARY}")
  add_test("${_knapserve_binary_name}_NOT_BUILT" "${_knapserve_binary_name}_NOT_BUILT")
  return()
endif()

if(NOT EXISTS "${KNAPSERVE_TESTS_FILE}" OR
   "${KNAPSERVE_TEST_BINARY}" IS_NEWER_THAN "${KNAPSERVE_TESTS_FILE}")
  execute_process(
    COMMAND "${KNAPSERVE_TEST_BINARY}" --gtest_list_tests
    WORKING_DIRECTORY "${KNAPSERVE_TEST_WORKDIR}"
    OUTPUT_VARIABLE _knapserve_list
    ERROR_VARIABLE _knapserve_list_err
    RESULT_VARIABLE _knapserve_rc
    TIMEOUT 120)
  if(NOT _knapserve_rc EQUAL 0)
    message(FATAL_ERROR
      "${KNAPSERVE_TEST_BINARY} --gtest_list_tests failed (${_knapserve_rc}):\n"
      "${_knapserve_list}\n${_knapserve_list_err}")
  endif()
  string(REPLACE "\n" ";" _knapserve_lines "${_knapserve_list}")
  set(_knapserve_out "")
  foreach(_line IN LISTS _knapserve_lines)
    # A suite line is "Suite." or "Prefix/Suite." or "Suite/0.", maybe
    # followed by "  # TypeParam = ..."; test lines are indented.
    if(_line MATCHES "^([^ #][^ ]*)\\.( +#.*)?$")
      set(_suite "${CMAKE_MATCH_1}")
      string(APPEND _knapserve_out
        "add_test([==[${_suite}]==] [==[${KNAPSERVE_TEST_BINARY}]==] [==[--gtest_filter=${_suite}.*]==])\n"
        "set_tests_properties([==[${_suite}]==] PROPERTIES"
        " WORKING_DIRECTORY [==[${KNAPSERVE_TEST_WORKDIR}]==]"
        " TIMEOUT ${KNAPSERVE_TEST_TIMEOUT}"
        " LABELS [==[${_knapserve_binary_name}]==]"
        " SKIP_REGULAR_EXPRESSION [==[knapserve tests: every test skipped]==])\n")
    endif()
  endforeach()
  file(WRITE "${KNAPSERVE_TESTS_FILE}" "${_knapserve_out}")
endif()
include("${KNAPSERVE_TESTS_FILE}")
