/* Naming for the math compiled once per instruction set (attention_math.c,
 * sampling_math.c): CMakeLists.txt builds each file again with
 * PP_ATTENTION_MATH_VARIANT set to the variant's name; the baseline build is
 * "generic". Include before any function of such a file is defined. */
#ifndef PP_MATH_VARIANT_H
#define PP_MATH_VARIANT_H

#ifndef PP_ATTENTION_MATH_VARIANT
#define PP_ATTENTION_MATH_VARIANT generic
#endif
#define PP_CONCAT_(a, b) a##_##b
#define PP_CONCAT(a, b) PP_CONCAT_(a, b)
#define PP_STR_(a) #a
#define PP_STR(a) PP_STR_(a)
/* Every function of a variant carries its name, so a disassembly shows
 * which code may use which instructions (tests/native/test_portability.py). */
#define FN(name) PP_CONCAT(name, PP_ATTENTION_MATH_VARIANT)

#endif
