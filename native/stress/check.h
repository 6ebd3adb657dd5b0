/*
 * check.h: the pass / fail counter the C stress programs share (thread-safe).
 *
 *   count(ok, "what");   CHECK(cond);   ... return report("program");
 *
 * report prints "program: N passed, M failed" as the last line and gives the exit status.
 */
#ifndef PF_STRESS_CHECK_H
#define PF_STRESS_CHECK_H

#include <pthread.h>
#include <stdio.h>

static int passed, failed;
static pthread_mutex_t count_mu = PTHREAD_MUTEX_INITIALIZER;

static void count(int ok, const char *what) {
    pthread_mutex_lock(&count_mu);
    if (ok)
        passed++;
    else {
        failed++;
        fprintf(stderr, "FAIL: %s\n", what);
    }
    pthread_mutex_unlock(&count_mu);
}

#define STR2(x) #x
#define STR(x) STR2(x)
#define CHECK(cond) count((cond), #cond " (" __FILE__ ":" STR(__LINE__) ")")

static int report(const char *program) {
    printf("%s: %d passed, %d failed\n", program, passed, failed);
    return failed ? 1 : 0;
}

#endif /* PF_STRESS_CHECK_H */
