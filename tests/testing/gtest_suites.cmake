# CTest tests for a GoogleTest binary, discovered when ctest runs
# (tests/CMakeLists.txt, knapserve_test_binary, includes this from the
# binary folder's CTestTestfile through a generated file that sets the
# variables below): one per run of up to KNAPSERVE_SUITES_PER_TEST
# consecutive suites, named after them joined by "+" (so `ctest -R Suite`
# still finds a suite).
#
# Why not one per test: every test process pays ~0.7 s of start-up (loading
# LibTorch and registering its operators) before its first test; with one
# process per test that was most of the suite's time on two cores, and one
# per suite still 2 minutes of CPU. A group's suites share a process, as they
# do when the binary is run by hand; ctest -j still runs groups side by
# side, longest first.
#
# A group whose every test skipped (GTEST_SKIP, e.g. ../shared missing) is
# reported as skipped: tests/test_main.cc prints "knapserve tests: every test
# skipped" only when no test of the run passed or failed.
#
# Inputs: KNAPSERVE_TEST_BINARY (the executable), KNAPSERVE_TESTS_FILE (where
# the add_test lines are cached; rewritten when the binary is newer),
# KNAPSERVE_TEST_WORKDIR, KNAPSERVE_TEST_TIMEOUT (seconds per test),
# KNAPSERVE_SUITES_PER_TEST, KNAPSERVE_SOLO_SUITES (suites that take a minute
# or more: each runs alone, so that ctest -j can balance them).

get_filename_component(_knapserve_binary_name "${KNAPSERVE_TEST_BINARY}" NAME)
if(NOT EXISTS "${KNAPSERVE_TEST_BINARY}")
  add_test("${_knapserve_binary_name}_NOT_BUILT" "${_knapserve_binary_name}_NOT_BUILT")
  return()
endif()

# The settings the cached file was written with, on its first line.
set(_knapserve_settings "# ${KNAPSERVE_SUITES_PER_TEST} ${KNAPSERVE_TEST_TIMEOUT} ${KNAPSERVE_SOLO_SUITES}")
set(_knapserve_cached_settings "")
if(EXISTS "${KNAPSERVE_TESTS_FILE}")
  file(STRINGS "${KNAPSERVE_TESTS_FILE}" _knapserve_cached_settings LIMIT_COUNT 1)
endif()
if(NOT _knapserve_cached_settings STREQUAL _knapserve_settings OR
   "${KNAPSERVE_TEST_BINARY}" IS_NEWER_THAN "${KNAPSERVE_TESTS_FILE}" OR
   "${CMAKE_CURRENT_LIST_FILE}" IS_NEWER_THAN "${KNAPSERVE_TESTS_FILE}")
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
  set(_knapserve_suites "")
  foreach(_line IN LISTS _knapserve_lines)
    # A suite line is "Suite." or "Prefix/Suite." or "Suite/0.", maybe
    # followed by "  # TypeParam = ..."; test lines are indented.
    if(_line MATCHES "^([^ #][^ ]*)\\.( +#.*)?$")
      list(APPEND _knapserve_suites "${CMAKE_MATCH_1}")
    endif()
  endforeach()
  set(_knapserve_out "${_knapserve_settings}\n")
  list(LENGTH _knapserve_suites _count)
  set(_start 0)
  while(_start LESS _count)
    math(EXPR _end "${_start} + ${KNAPSERVE_SUITES_PER_TEST}")
    if(_end GREATER _count)
      set(_end ${_count})
    endif()
    set(_name "")
    set(_filter "")
    # A solo suite ends the group before it, or is a group of its own.
    set(_i ${_start})
    while(_i LESS _end)
      list(GET _knapserve_suites ${_i} _suite)
      list(FIND KNAPSERVE_SOLO_SUITES "${_suite}" _solo)
      if(_solo GREATER -1)
        if(_i EQUAL _start)
          math(EXPR _end "${_i} + 1")
        else()
          set(_end ${_i})
          break()
        endif()
      endif()
      math(EXPR _i "${_i} + 1")
    endwhile()
    set(_i ${_start})
    while(_i LESS _end)
      list(GET _knapserve_suites ${_i} _suite)
      if(_name)
        string(APPEND _name "+")
        string(APPEND _filter ":")
      endif()
      string(APPEND _name "${_suite}")
      string(APPEND _filter "${_suite}.*")
      math(EXPR _i "${_i} + 1")
    endwhile()
    string(APPEND _knapserve_out
      "add_test([==[${_name}]==] [==[${KNAPSERVE_TEST_BINARY}]==] [==[--gtest_filter=${_filter}]==])\n"
      "set_tests_properties([==[${_name}]==] PROPERTIES"
      " WORKING_DIRECTORY [==[${KNAPSERVE_TEST_WORKDIR}]==]"
      " TIMEOUT ${KNAPSERVE_TEST_TIMEOUT}"
      " LABELS [==[${_knapserve_binary_name}]==]"
      " SKIP_REGULAR_EXPRESSION [==[knapserve tests: every test skipped]==])\n")
    set(_start ${_end})
  endwhile()
  file(WRITE "${KNAPSERVE_TESTS_FILE}" "${_knapserve_out}")
endif()
include("${KNAPSERVE_TESTS_FILE}")
