/*
 * version.c — mst_version(): the version this library was built as, from the
 * header's MST_VERSION_* (CMake reads the project version from them too).
 */
#include "moestash.h"

#define MST_STR_(x) #x
#define MST_STR(x) MST_STR_(x)

const char* mst_version(void) {
    return MST_STR(MST_VERSION_MAJOR) "." MST_STR(MST_VERSION_MINOR) "." MST_STR(MST_VERSION_PATCH);
}
