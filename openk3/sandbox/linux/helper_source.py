"""Source of `openk3-enter`, the one host-side program between the daemon and a sandbox (built by helper.py).

Why a compiled, static program: a command must join the sandbox's namespaces and root and drop its capabilities before any of
the sandbox's files run. Entering a user namespace with setns(2) hands back a full capability set there (bounding set
included), so the drop has to happen after the last setns and before the exec; any dynamically linked host tool doing it
after the root switch (the sandbox's own `setpriv`, or the host's) would load its ld.so and libc from the sandbox's tree.
A static binary has everything mapped before it enters. It also loads the seccomp filter, because processes that join from
outside do not inherit the one bwrap gave the init. The command, its working directory and its environment come through a
memfd rather than the command line: /proc/<pid>/cmdline is readable by every host user, a caller's variables are not theirs.
"""

C_SOURCE = r"""
/* openk3-enter (see openk3/sandbox/linux/helper_source.py and helper.py).

   spawn UID NPROCS PROCS... ARGV...
       write our pid into each cgroup.procs file, drop to host uid/gid UID (or stay when UID is "-") with no supplementary
       groups, then exec ARGV[0] (an absolute host path) with the inherited environment.
   enter PIDFD PID BPF SPECFD NPROCS PROCS...
   enter-tty PIDFD PID BPF SPECFD NPROCS PROCS...
       read the command from SPECFD (NUL-terminated strings: CWD, NENV, NENV variables ENV, then ARGV), join the cgroups,
       then the namespaces and root of the sandbox init PID (PIDFD must be the daemon's pidfd of that init, which proves the
       pid was not reused), become the sandbox's root, drop every capability, set no_new_privs, load the seccomp program BPF
       (hex of struct sock_filter), fork into the pid namespace. The child starts a session of its own (so it can signal
       neither the daemon's process group nor another sandbox's, and has no controlling terminal), closes every descriptor
       above 2, changes to CWD and execs ARGV with exactly the variables ENV (PATH lookup inside the sandbox); the parent
       exits as the child did. With enter-tty, stdin must be a terminal (the slave of a pty of the sandbox's own devpts),
       which the child makes the controlling terminal of its new session, so job control and Ctrl-C work as in a terminal.
   userns
       unshare a user namespace (no ids mapped yet), print "ready" and wait in it until stdin closes; the daemon writes
       its uid_map and gid_map and opens /proc/<pid>/ns/user meanwhile (it cannot unshare itself: it has threads).
   Exit status 125 with a line "openk3-enter: ..." on stderr: the sandbox could not be entered and no part of ARGV ran. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define ENTER_FAILED 125
extern char **environ;

static void die(const char *fmt, ...) {
    int saved = errno;
    va_list ap;
    va_start(ap, fmt);
    fputs("openk3-enter: ", stderr);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, ": %s\n", strerror(saved));
    va_end(ap);
    exit(ENTER_FAILED);
}

static long number(const char *s, const char *what) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < 0) {
        errno = EINVAL;
        die("%s %s", what, s);
    }
    return v;
}

static void need(int ok) {
    if (!ok) {
        errno = EINVAL;
        die("usage: spawn UID NPROCS PROCS... ARGV... | enter[-tty] PIDFD PID BPF SPECFD NPROCS PROCS... | userns");
    }
}

static void join_cgroups(long n, char **files) {
    char pid[32];
    int len = snprintf(pid, sizeof pid, "%d", (int)getpid());
    for (long i = 0; i < n; i++) {
        int fd = open(files[i], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, pid, len) != len)
            die("join cgroup %s", files[i]);
        close(fd);
    }
}

/* The user namespace comes last: the others may belong to its parent (bwrap --disable-userns nests one more), and host root
   can join those only before it leaves the host's user namespace. */
static const char *const NS_NAMES[] = {"ipc", "uts", "net", "pid", "cgroup", "mnt"};
static const int NS_TYPES[] = {CLONE_NEWIPC, CLONE_NEWUTS, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWCGROUP, CLONE_NEWNS};

static void enter_sandbox(int pidfd, long pid) {
    char path[64];
    int fds[6];
    for (int i = 0; i < 6; i++) {
        snprintf(path, sizeof path, "/proc/%ld/ns/%s", pid, NS_NAMES[i]);
        if ((fds[i] = open(path, O_RDONLY | O_CLOEXEC)) < 0)
            die("open %s", path);
    }
    snprintf(path, sizeof path, "/proc/%ld/ns/user", pid);
    int userfd = open(path, O_RDONLY | O_CLOEXEC);
    snprintf(path, sizeof path, "/proc/%ld/root", pid);
    int rootfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (userfd < 0 || rootfd < 0)
        die("open the namespaces of sandbox init %ld", pid);
    /* The descriptors name the daemon's init only if that process still exists now that they are open. */
    if (syscall(SYS_pidfd_send_signal, pidfd, 0, NULL, 0) != 0)
        die("sandbox init %ld is gone", pid);
    if (setgroups(0, NULL) != 0)
        die("clear supplementary groups");
    for (int i = 0; i < 6; i++)
        if (setns(fds[i], NS_TYPES[i]) != 0)
            die("join the %s namespace", NS_NAMES[i]);
    if (fchdir(rootfd) != 0 || chroot(".") != 0)
        die("change to the sandbox root");
    if (setns(userfd, CLONE_NEWUSER) != 0)
        die("join the user namespace");
    if (setgid(0) != 0 || setuid(0) != 0)
        die("become the sandbox's root user");
    for (int i = 0; i < 6; i++)
        close(fds[i]);
    close(userfd);
    close(rootfd);
    close(pidfd);
}

static void drop_capabilities(void) {
    for (int cap = 0; prctl(PR_CAPBSET_READ, cap, 0, 0, 0) >= 0; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0)
            die("drop capability %d from the bounding set", cap);
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0)
        die("clear ambient capabilities");
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    memset(data, 0, sizeof data);
    if (syscall(SYS_capset, &header, data) != 0)
        die("clear capabilities");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        die("set no_new_privs");
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
}

static void load_seccomp(const char *hex) {
    size_t n = strlen(hex);
    errno = EINVAL;
    if (n == 0 || n % (2 * sizeof(struct sock_filter)) != 0 || n / 2 / sizeof(struct sock_filter) > BPF_MAXINSNS)
        die("seccomp program of %zu hex digits", n);
    unsigned char *bytes = malloc(n / 2);
    if (bytes == NULL)
        die("seccomp program");
    for (size_t i = 0; i < n / 2; i++) {
        int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            errno = EINVAL;
            die("seccomp program: not lowercase hex");
        }
        bytes[i] = (unsigned char)(hi << 4 | lo);
    }
    struct sock_fprog prog = {(unsigned short)(n / 2 / sizeof(struct sock_filter)), (struct sock_filter *)bytes};
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) != 0)
        die("load the seccomp filter");
    free(bytes);
}

static int spawn(int argc, char **argv) {
    int i = 2;
    need(i + 2 < argc);
    long uid = strcmp(argv[i], "-") == 0 ? -1 : number(argv[i], "uid");
    long nprocs = number(argv[++i], "cgroup count");
    need(nprocs < argc - ++i);
    join_cgroups(nprocs, &argv[i]);
    i += nprocs;
    if (uid >= 0 && (setgroups(0, NULL) != 0 || setgid((gid_t)uid) != 0 || setuid((uid_t)uid) != 0))
        die("drop to uid %ld", uid);
    execv(argv[i], &argv[i]);
    die("exec %s", argv[i]);
    return ENTER_FAILED;
}

struct command {
    char *cwd;
    char **env; /* NULL-terminated */
    char **argv; /* NULL-terminated, at least one element */
};

/* The spec is a sequence of NUL-terminated strings: CWD, NENV, NENV variables, then the argv (the rest, at least one). */
static struct command read_command(int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0)
        die("command spec on fd %d", fd);
    if (st.st_size <= 0 || st.st_size > (64L << 20)) {
        errno = EINVAL;
        die("command spec of %lld bytes", (long long)st.st_size);
    }
    size_t size = (size_t)st.st_size;
    char *buf = malloc(size);
    if (buf == NULL)
        die("command spec");
    for (size_t got = 0; got < size;) {
        ssize_t n = pread(fd, buf + got, size - got, (off_t)got);
        if (n <= 0) {
            errno = n == 0 ? EINVAL : errno;
            die("read the command spec");
        }
        got += (size_t)n;
    }
    close(fd);
    errno = EINVAL;
    if (buf[size - 1] != '\0')
        die("command spec: not NUL-terminated");
    size_t nstrings = 0;
    for (size_t k = 0; k < size; k++)
        nstrings += buf[k] == '\0';
    char **strings = calloc(nstrings + 2, sizeof *strings);
    if (strings == NULL)
        die("command spec");
    for (size_t k = 0, at = 0; k < nstrings; k++) {
        strings[k] = buf + at;
        at += strlen(buf + at) + 1;
    }
    /* Counts are compared as differences, so no sum can overflow: CWD, NENV, the variables, then at least one argv word. */
    need(nstrings >= 3);
    long nenv = number(strings[1], "variable count");
    need((size_t)nenv <= nstrings - 3);
    /* environ must end with NULL: move the variables down one slot, over NENV's string, and end them there. The argv
       keeps its place and ends with calloc's extra NULL. */
    memmove(&strings[1], &strings[2], (size_t)nenv * sizeof *strings);
    strings[1 + nenv] = NULL;
    struct command c = {strings[0], &strings[1], &strings[2 + nenv]};
    return c;
}

static int enter(int argc, char **argv, int tty) {
    int i = 2;
    need(i + 4 < argc);
    int pidfd = (int)number(argv[i++], "pidfd");
    long pid = number(argv[i++], "pid");
    const char *bpf = argv[i++];
    struct command c = read_command((int)number(argv[i++], "spec fd"));
    long nprocs = number(argv[i++], "cgroup count");
    need(nprocs == argc - i);
    join_cgroups(nprocs, &argv[i]);
    enter_sandbox(pidfd, pid);
    drop_capabilities();
    load_seccomp(bpf);
    pid_t child = fork();
    if (child < 0)
        die("fork into the sandbox's pid namespace");
    if (child == 0) {
        /* A session of its own, right away: sharing the daemon's process group would let `kill 0` reach the daemon and
           every other sandbox's helpers, and sharing its session would give /dev/tty (TIOCSTI) on the operator's terminal. */
        if (setsid() < 0)
            die("start a session");
        if (tty && ioctl(0, TIOCSCTTY, 0) != 0)
            die("make stdin the controlling terminal");
        environ = c.env;
        if (syscall(SYS_close_range, 3, ~0U, 0) != 0)
            die("close inherited descriptors");
        if (chdir(c.cwd) != 0) {
            fprintf(stderr, "openk3-enter: cd %s: %s\n", c.cwd, strerror(errno));
            _exit(1);
        }
        execvp(c.argv[0], c.argv);
        int code = errno == ENOENT ? 127 : 126;
        fprintf(stderr, "openk3-enter: %s: %s\n", c.argv[0], strerror(errno));
        _exit(code);
    }
    /* Only the command's own tree may hold its pipes, so its output ends when it does. */
    close(0);
    close(1);
    close(2);
    int status;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR)
            return ENTER_FAILED;
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    signal(WTERMSIG(status), SIG_DFL);
    kill(getpid(), WTERMSIG(status));
    return 128 + WTERMSIG(status);
}

static int userns(int argc) {
    need(argc == 2);
    if (unshare(CLONE_NEWUSER) != 0)
        die("unshare a user namespace");
    if (write(1, "ready\n", 6) != 6)
        die("say ready");
    char b;
    for (;;) {
        ssize_t n = read(0, &b, 1);
        if (n == 0)
            return 0;
        if (n < 0 && errno != EINTR)
            die("wait for stdin to close");
    }
}

int main(int argc, char **argv) {
    need(argc >= 2);
    if (strcmp(argv[1], "spawn") == 0)
        return spawn(argc, argv);
    if (strcmp(argv[1], "enter") == 0)
        return enter(argc, argv, 0);
    if (strcmp(argv[1], "enter-tty") == 0)
        return enter(argc, argv, 1);
    if (strcmp(argv[1], "userns") == 0)
        return userns(argc);
    need(0);
    return ENTER_FAILED;
}
"""
