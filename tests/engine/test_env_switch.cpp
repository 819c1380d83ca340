// The measurement switches' reading (src/base/env_switch.h), against hand-worked cases: a switch
// is off only when its variable is exactly "0".
#include <cstdio>
#include <cstdlib>

#include "base/env_switch.h"

static int failures = 0;

static void expect(const char *value, bool want) {
    const char *name = "RP_TEST_ENV_SWITCH";
    if (value)
        setenv(name, value, 1);
    else
        unsetenv(name);
    if (rp::env_switch_on(name) != want) {
        std::fprintf(stderr, "FAIL value %s: got %d, want %d\n", value ? value : "(unset)", !want,
                     want);
        ++failures;
    }
}

int main() {
    expect(nullptr, true); // unset: on
    expect("0", false);    // the one way to turn it off
    expect("1", true);
    expect("", true);
    expect("00", true);
    expect("0 ", true);
    expect("off", true); // not a recognised "off": the feature stays on
    if (failures == 0)
        std::printf("env_switch: all cases hold\n");
    return failures == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
