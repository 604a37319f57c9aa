#!/usr/bin/env python3
"""Makes Debian's LibTorch 1.13 headers compile with clang in C++20 mode.

LibTorch 1.13's ATen/core/List.h does not compile with clang in C++20 mode
against libstdc++ 12 (pytorch/pytorch#97689: two inline functions use
std::vector<IValue> members while IValue is incomplete, and clang
instantiates the now-constexpr vector members on the spot). write_overlay()
puts a patched copy of that one header (those two functions made lazy;
nothing else changes) under DIR/ATen/core/List.h, to be searched before the
installed headers (-isystem DIR). A LibTorch whose List.h no longer has
those lines needs no overlay.

Used by tools/check_thread_safety.sh and tools/fuzz.sh. As a command:
  clang_libtorch_overlay.py DIR   prints DIR if it wrote the overlay, else
                                  nothing.
"""
import os
import sys

FIXES = [("  explicit ListImpl(list_type list_, TypePtr elementType_)\n",
          "  template <class L = list_type>\n"
          "  explicit ListImpl(L list_, TypePtr elementType_)\n"),
         ("  return &list.impl_->list[0];\n", "  return list.impl_->list.data();\n")]


def write_overlay(directory):
    """Writes the patched List.h under `directory`; True if it did."""
    for include in ("/usr/include", "/usr/local/include"):
        path = os.path.join(include, "ATen/core/List.h")
        if not os.path.isfile(path):
            continue
        text = open(path).read()
        if not all(old in text for old, _ in FIXES):
            return False
        for old, new in FIXES:
            text = text.replace(old, new)
        os.makedirs(os.path.join(directory, "ATen/core"), exist_ok=True)
        with open(os.path.join(directory, "ATen/core/List.h"), "w") as out:
            out.write(text)
        return True
    return False


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: clang_libtorch_overlay.py DIR")
    if write_overlay(sys.argv[1]):
        print(sys.argv[1])
