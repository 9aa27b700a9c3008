/*
 * clock.h — the monotonic clock that every timer, deadline and timed
 * benchmark of the project reads (CLOCK_MONOTONIC: an arbitrary origin, never
 * set back).
 */
#ifndef MST_CLOCK_H
#define MST_CLOCK_H

#include <stdint.h>

double mst_clock_s(void);   /* seconds                                  */
int64_t mst_clock_ms(void); /* whole milliseconds (deadlines, timeouts) */

#endif
