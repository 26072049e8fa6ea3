/* Loaded into tritonserver, and the python-backend stubs it starts, by LD_PRELOAD (launcher/triton_shim.py).
 *
 * 1. Triton 2.51 takes its repository-API token only on its command line, which every local user can read from
 *    /proc/<pid>/cmdline. The launcher passes a placeholder there instead and the token by environment; before
 *    main runs, this puts the token in place of the placeholder in main's argv (a copy: the command line the
 *    kernel shows keeps the placeholder) and drops the token from the environment the stubs inherit.
 * 2. The python backend sets its /dev/shm regions (every prompt, media item and output) to 0644 with fchmod,
 *    whatever the umask; on /dev/shm this keeps them the user's alone (0600).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

static const char PLACEHOLDER[] = "@TRIDENT_ACCESS_TOKEN@";
static const char TOKEN_ENV[] = "TRIDENT_ACCESS_TOKEN";

__attribute__((constructor)) static void put_token(int argc, char **argv, char **envp) {
    (void)envp;
    const size_t mark = sizeof PLACEHOLDER - 1;
    const char *token = getenv(TOKEN_ENV);
    for (int i = 0; i < argc; i++) {
        char *at = strstr(argv[i], PLACEHOLDER);
        if (at == NULL) continue;
        if (token == NULL || *token == '\0') {
            fprintf(stderr, "trident: %s is not set: refusing to start with the placeholder token\n", TOKEN_ENV);
            _exit(78);
        }
        size_t head = (size_t)(at - argv[i]), len = strlen(token), tail = strlen(at + mark);
        char *arg = malloc(head + len + tail + 1);
        if (arg == NULL) _exit(71);
        memcpy(arg, argv[i], head);
        memcpy(arg + head, token, len);
        memcpy(arg + head + len, at + mark, tail + 1);
        argv[i] = arg;
    }
    unsetenv(TOKEN_ENV);
}

int fchmod(int fd, mode_t mode) {
    static int (*real_fchmod)(int, mode_t);
    if (real_fchmod == NULL) real_fchmod = (int (*)(int, mode_t))dlsym(RTLD_NEXT, "fchmod");
    char link[64], path[32];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n >= 9 && strncmp(path, "/dev/shm/", 9) == 0) mode &= 0700;
    return real_fchmod(fd, mode);
}
