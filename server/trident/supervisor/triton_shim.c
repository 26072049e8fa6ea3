/* Loaded into tritonserver, and the python-backend stubs it starts, by LD_PRELOAD (supervisor/triton_shim.py).
 *
 * 1. Triton 2.51 takes its repository-API token only on its command line, which every local user can read from
 *    /proc/<pid>/cmdline. The launcher passes a placeholder there instead and the token by environment; before
 *    main runs, this puts the token in place of the placeholder in main's argv (a copy: the command line the
 *    kernel shows keeps the placeholder) and drops the token from the environment the stubs inherit.
 * 2. The python backend sets its /dev/shm regions (every prompt, media item and output) to 0644 with fchmod,
 *    whatever the umask; on /dev/shm this keeps them the user's alone (0600).
 * 3. A repository `load` with model files (`file:<path>` parameters: HTTP, gRPC or a BLS's load) runs the code it
 *    uploads as the service's user. Triton 2.51 has no switch for them; this refuses every load carrying one
 *    unless TRIDENT_ALLOW_CODE_UPLOAD=1 (the config's allow_code_upload). Trident binds no model that way.
 *    Nor a load whose config override names a host file (default_model_filename as a path, EXECUTION_ENV_PATH),
 *    whatever the setting.
 * 4. Model-config auto-completion off (below).
 * 5. Freed large buffers go back to the system (below).
 * 6. Triton in a process group of its own (below).
 * 7. Triton's HTTP, metrics and gRPC servers on Unix sockets, behind the launcher's fronts (below).
 * 8. The python backend's temporary folder named for the launcher, which removes it after a Triton that was killed (below).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <stdint.h>
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

/* -- 3. model-file uploads --------------------------------------------------------------------------------------- */
typedef struct TRITONSERVER_Parameter TRITONSERVER_Parameter;
typedef struct TRITONSERVER_Error TRITONSERVER_Error;
typedef struct TRITONSERVER_Server TRITONSERVER_Server;
enum { TRITONSERVER_ERROR_UNSUPPORTED = 5 }; /* tritonserver.h: HTTP 501, gRPC UNIMPLEMENTED */

static const char REFUSED[] =
    "model-file uploads (load parameters 'file:...') are off on this Trident server: they would run the uploaded code "
    "as the server's user. The operator can turn them on with allow_code_upload: true in the config file";

static const char CONFIG_REFUSED[] =
    "a load's config override may not set default_model_filename to a path or set EXECUTION_ENV_PATH (nor write a "
    "\\u escape, which could spell either): they name files on the server's host, which the python backend runs";

/* The live parameters a load is refused for: a model file (reason REFUSED) or a config override naming a host file
 * (CONFIG_REFUSED). */
static pthread_mutex_t refused_lock = PTHREAD_MUTEX_INITIALIZER;
static struct { const void *param; const char *reason; } *refused;
static size_t n_refused, cap_refused;

static int uploads_allowed(void) {
    const char *allow = getenv("TRIDENT_ALLOW_CODE_UPLOAD");
    return allow != NULL && strcmp(allow, "1") == 0;
}

static void track(const void *param, const char *reason) {
    pthread_mutex_lock(&refused_lock);
    if (n_refused == cap_refused) {
        size_t cap = cap_refused ? 2 * cap_refused : 16;
        void *grown = realloc(refused, cap * sizeof *refused);
        if (grown == NULL) _exit(71); /* (never let one through untracked) */
        refused = grown;
        cap_refused = cap;
    }
    refused[n_refused].param = param;
    refused[n_refused++].reason = reason;
    pthread_mutex_unlock(&refused_lock);
}

TRITONSERVER_Parameter *TRITONSERVER_ParameterBytesNew(const char *name, const void *byte_ptr, uint64_t size) {
    static TRITONSERVER_Parameter *(*real)(const char *, const void *, uint64_t);
    if (real == NULL) real = (TRITONSERVER_Parameter * (*)(const char *, const void *, uint64_t))
                                 dlsym(RTLD_NEXT, "TRITONSERVER_ParameterBytesNew");
    TRITONSERVER_Parameter *param = real(name, byte_ptr, size);
    if (param != NULL && name != NULL && strncmp(name, "file:", 5) == 0 && !uploads_allowed()) track(param, REFUSED);
    return param;
}

enum { TRITONSERVER_PARAMETER_STRING = 0 }; /* tritonserver.h */

/* 3b. A load's "config" override (JSON) whose default_model_filename is a path ("../..") or that sets
 *     EXECUTION_ENV_PATH names a file on the host that the python backend hands to `bash -c`. Trident's own overrides
 *     set neither (a BLS config read back from Triton has default_model_filename "model.py": a plain name passes); a
 *     \u escape in the text could spell either key past this check, so it is refused too. */
static int names_a_host_file(const char *text) {
    if (strstr(text, "EXECUTION_ENV_PATH") || strstr(text, "\\u")) return 1;
    static const char *const KEYS[] = {"\"default_model_filename\"", "\"defaultModelFilename\""}; /* (protobuf's JSON: both) */
    for (size_t k = 0; k < 2; k++)
    for (const char *at = strstr(text, KEYS[k]); at != NULL; at = strstr(at + 1, KEYS[k])) {
        const char *v = at + strlen(KEYS[k]);
        while (*v == ' ' || *v == '\t' || *v == '\n' || *v == '\r' || *v == ':') v++;
        if (*v != '"') return 1; /* (not a string: refused rather than guessed at) */
        size_t n = 0;
        for (v++; v[n] != '"'; n++) {
            if (v[n] == '\0' || v[n] == '/' || v[n] == '\\') return 1; /* a path, or an escape that could make one */
        }
        if (n == 0 || (n <= 2 && strncmp(v, "..", n) == 0)) return 1; /* "", ".", ".." */
    }
    return 0;
}

TRITONSERVER_Parameter *TRITONSERVER_ParameterNew(const char *name, int type, const void *value) {
    static TRITONSERVER_Parameter *(*real)(const char *, int, const void *);
    if (real == NULL) real = (TRITONSERVER_Parameter * (*)(const char *, int, const void *))
                                 dlsym(RTLD_NEXT, "TRITONSERVER_ParameterNew");
    TRITONSERVER_Parameter *param = real(name, type, value);
    if (param != NULL && name != NULL && strcmp(name, "config") == 0 && type == TRITONSERVER_PARAMETER_STRING &&
        value != NULL && names_a_host_file(value))
        track(param, CONFIG_REFUSED);
    return param;
}

void TRITONSERVER_ParameterDelete(TRITONSERVER_Parameter *parameter) {
    static void (*real)(TRITONSERVER_Parameter *);
    if (real == NULL) real = (void (*)(TRITONSERVER_Parameter *))dlsym(RTLD_NEXT, "TRITONSERVER_ParameterDelete");
    pthread_mutex_lock(&refused_lock);
    for (size_t i = 0; i < n_refused; i++) {
        if (refused[i].param == parameter) {
            refused[i] = refused[--n_refused];
            break;
        }
    }
    pthread_mutex_unlock(&refused_lock);
    real(parameter);
}

TRITONSERVER_Error *TRITONSERVER_ServerLoadModelWithParameters(TRITONSERVER_Server *server, const char *model_name,
                                                               const TRITONSERVER_Parameter **parameters,
                                                               const uint64_t parameter_count) {
    static TRITONSERVER_Error *(*real)(TRITONSERVER_Server *, const char *, const TRITONSERVER_Parameter **,
                                       const uint64_t);
    static TRITONSERVER_Error *(*error_new)(int, const char *);
    if (real == NULL) {
        real = (TRITONSERVER_Error * (*)(TRITONSERVER_Server *, const char *, const TRITONSERVER_Parameter **,
                                         const uint64_t))dlsym(RTLD_NEXT, "TRITONSERVER_ServerLoadModelWithParameters");
        error_new = (TRITONSERVER_Error * (*)(int, const char *))dlsym(RTLD_NEXT, "TRITONSERVER_ErrorNew");
    }
    const char *reason = NULL;
    pthread_mutex_lock(&refused_lock);
    for (uint64_t p = 0; p < parameter_count && reason == NULL; p++)
        for (size_t i = 0; i < n_refused && reason == NULL; i++)
            if (refused[i].param == (const void *)parameters[p]) reason = refused[i].reason;
    pthread_mutex_unlock(&refused_lock);
    if (reason != NULL) return error_new(TRITONSERVER_ERROR_UNSUPPORTED, reason);
    return real(server, model_name, parameters, parameter_count);
}

/* 4. At each model load the python backend starts a stub process only to let the model complete its config, unless
 *    auto-completion is off (tritonserver's --disable-auto-complete-config, which PyTriton's Triton cannot pass: it
 *    writes every flag with a value). Trident writes every config whole, so this turns it off for every backend: one
 *    Python start-up less per model load (the stage models, the entry models, the bind model). */
typedef struct TRITONBACKEND_Model TRITONBACKEND_Model;

TRITONSERVER_Error *TRITONBACKEND_ModelAutoCompleteConfig(TRITONBACKEND_Model *model, _Bool *auto_complete_config) {
    (void)model;
    *auto_complete_config = 0;
    return NULL;
}

/* 5. glibc raises its mmap threshold each time a large mapped buffer is freed (up to 32 MiB), after which requests'
 *    buffers (base64 media, response tensors) come from the heaps, which keep them when freed: under load Triton's RSS
 *    grew by 10-15% and did not come back. A fixed threshold keeps buffers of 64 KiB and more mapped, and unmapped
 *    when freed: the RSS follows the load down again (docs/reliability.md, the soak). */
__attribute__((constructor)) static void give_freed_buffers_back(void) { mallopt(M_MMAP_THRESHOLD, 64 * 1024); }

/* 6. A terminal's Ctrl-C (SIGINT to its foreground process group) is the launcher's to handle: it withdraws readiness,
 *    answers new requests 503, lets the streams in flight finish, then stops Triton. PyTriton starts tritonserver in
 *    the launcher's group, where it took the SIGINT too and stopped at once, its endpoints first. So tritonserver (and
 *    with it the stubs it starts) runs in a process group of its own; its parent's death still ends it (PyTriton's
 *    PR_SET_PDEATHSIG). */
__attribute__((constructor)) static void own_process_group(void) {
    if (strcmp(program_invocation_short_name, "tritonserver") == 0) setpgid(0, 0);
}

/* 7. Triton 2.51's HTTP server reads bodies of any size, and a chunked body of many small chunks ends it (one stack
 *    entry per chunk). The launcher's fronts (supervisor/http_front.py, supervisor/grpc_front.py) take the public
 *    HTTP, metrics and gRPC ports and relay to Triton over Unix sockets in the server's workspace, its user's alone;
 *    PyTriton, which writes --http-address=HOST (and the others) and calls the public port, is left as it is. This puts
 *    unix:<path> in place of each HOST (before main, in its argv copy). Asked for and not done is an exit: Triton must
 *    never listen on the public ports itself. */
static void put_socket(int argc, char **argv, const char *flag, const char *env) {
    const char *path = getenv(env);
    if (path == NULL) return;
    size_t n = strlen(flag);
    int done = 0;
    for (int i = 0; i < argc; i++) {
        int joined = strncmp(argv[i], flag, n) == 0 && argv[i][n] == '='; /* --flag=HOST, or --flag HOST */
        if (!joined && !(strcmp(argv[i], flag) == 0 && i + 1 < argc)) continue;
        if (!joined) i++;
        char *arg = malloc(n + 6 + strlen(path) + 1);
        if (arg == NULL) _exit(71);
        sprintf(arg, "%s%sunix:%s", joined ? flag : "", joined ? "=" : "", path);
        argv[i] = arg;
        done = 1;
    }
    if (!done) {
        fprintf(stderr, "trident: %s is set but tritonserver has no %s argument\n", env, flag);
        _exit(78);
    }
    unsetenv(env);
}

__attribute__((constructor)) static void behind_the_front(int argc, char **argv, char **envp) {
    (void)envp;
    if (strcmp(program_invocation_short_name, "tritonserver") != 0) return;
    put_socket(argc, argv, "--http-address", "TRIDENT_HTTP_SOCKET");
    put_socket(argc, argv, "--metrics-address", "TRIDENT_METRICS_SOCKET");
    put_socket(argc, argv, "--grpc-address", "TRIDENT_GRPC_SOCKET"); /* (gRPC appends :PORT to the path) */
}

/* 8. The python backend makes a folder /tmp/python_env_XXXXXX at start (for EXECUTION_ENV_PATH archives, which Trident
 *    refuses) and removes it at a clean exit; a Triton killed (SIGKILL, a crash) leaves it behind. Each folder Triton
 *    makes there is appended, a line each, to the file TRIDENT_TEMP_RECORD names (in the server's workspace), from which
 *    the launcher removes those left once that Triton has exited. */
char *mkdtemp(char *template) {
    static char *(*real_mkdtemp)(char *);
    if (real_mkdtemp == NULL) real_mkdtemp = (char *(*)(char *))dlsym(RTLD_NEXT, "mkdtemp");
    char *made = real_mkdtemp(template);
    const char *record = getenv("TRIDENT_TEMP_RECORD");
    if (made == NULL || record == NULL || strcmp(program_invocation_short_name, "tritonserver") != 0) return made;
    int fd = open(record, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd >= 0) {
        size_t n = strlen(made);
        char *line = malloc(n + 2);
        if (line != NULL) {
            memcpy(line, made, n);
            line[n] = '\n';
            ssize_t w = write(fd, line, n + 1); /* (one write: whole lines, appended) */
            (void)w;
            free(line);
        }
        close(fd);
    }
    return made;
}
