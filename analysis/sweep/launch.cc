// Launching one run of a point: the command line (mpirun, srun or the spec's
// template) and a child process group with a time limit.
#include <fcntl.h>
#include <sys/resource.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <fstream>
#include <thread>

#include "core/error.h"
#include "analysis/sweep/sweep.h"

namespace xirang::analysis::sweep {

std::string shell_quote(const std::string& s) {
  if (!s.empty() && s.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-./=:,+@%") ==
                        std::string::npos)
    return s;
  std::string r = "'";
  for (char c : s) r += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return r + "'";
}

namespace {

void replace_all(std::string& s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size())) s.replace(at, from.size(), to);
}

}  // namespace

std::string launch_command(const Spec& spec, const Point& p, int ranks, const std::string& xirang,
                           const std::string& run_dir) {
  // The point's metrics go to its own folder; everything else is the spec's.
  std::string args = "train " + shell_quote(spec.base);
  for (const std::string& o : p.overrides) args += str_cat(" --set ", shell_quote(o));
  args += str_cat(" --set train.steps=", spec.steps, " --set ", shell_quote("metrics.jsonl=" + run_dir + "/metrics.jsonl"));
  std::string extra;
  for (const std::string& a : spec.launcher.args) extra += str_cat(" ", shell_quote(a));
  switch (spec.launcher.kind) {
    case LauncherKind::Mpirun:
      return str_cat("mpirun -np ", ranks, extra, " ", shell_quote(xirang), " ", args);
    case LauncherKind::Srun:
      return str_cat("srun --mpi=pmix -n ", ranks, extra, " ", shell_quote(xirang), " ", args);
    case LauncherKind::Template: break;
  }
  std::string cmd = spec.launcher.text;
  replace_all(cmd, "{ranks}", std::to_string(ranks));
  replace_all(cmd, "{xirang}", shell_quote(xirang));
  replace_all(cmd, "{id}", shell_quote(p.id));
  replace_all(cmd, "{dir}", shell_quote(run_dir));
  replace_all(cmd, "{args}", args);
  return cmd;
}

namespace {

// In the child: a session and process group of its own (so a timeout can
// end mpirun and every rank it started, and the run's scheduling group is
// its own), the priority, output into the log, the spec's environment.
[[noreturn]] void exec_child(const std::string& cmd, const std::string& log_path,
                             const std::map<std::string, std::string>& env, std::optional<int> priority) {
  ::setsid();
  if (priority) {
    // Failures leave the run at normal priority; priority_problem() said why before the sweep began.
    const int fdg = ::open("/proc/self/autogroup", O_WRONLY);
    if (fdg >= 0) {
      const std::string v = std::to_string(*priority);
      [[maybe_unused]] ssize_t n = ::write(fdg, v.data(), v.size());
      ::close(fdg);
    }
    ::setpriority(PRIO_PROCESS, 0, *priority);
  }
  const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::close(fd);
  }
  const int null = ::open("/dev/null", O_RDONLY);
  if (null >= 0) ::dup2(null, 0);
  for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
  ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
  ::_exit(127);
}

// The process group of the run in progress (0: none). An interrupted sweep
// (Ctrl-C, SIGTERM from scancel or a job's time limit) takes it along: the
// group is not the terminal's foreground group, so nothing else would.
volatile sig_atomic_t running_group = 0;

// Only async-signal-safe calls: kill, nanosleep, signal, raise.
extern "C" void end_with_run(int sig) {
  const pid_t group = pid_t(running_group);
  if (group > 0) {
    ::kill(-group, SIGTERM);
    const timespec tick{0, 100 * 1000 * 1000};
    for (int i = 0; i < 30 && ::kill(-group, 0) == 0; ++i) ::nanosleep(&tick, nullptr);
    ::kill(-group, SIGKILL);
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void forward_interrupts() {
  static bool installed = false;
  if (installed) return;
  installed = true;
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::signal(sig, end_with_run);
}

// SIGTERM to the group, then SIGKILL to whatever is left of it after a grace period.
void kill_group(pid_t pid, int* status) {
  ::kill(-pid, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    if (::waitpid(pid, status, WNOHANG) == pid) {
      ::kill(-pid, SIGKILL);  // ranks the shell left behind
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(-pid, SIGKILL);
  ::waitpid(pid, status, 0);
}

// CPU time of reaped children, in seconds.
double children_cpu_s() {
  rusage u{};
  if (::getrusage(RUSAGE_CHILDREN, &u) != 0) return -1;
  return double(u.ru_utime.tv_sec + u.ru_stime.tv_sec) + 1e-6 * double(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

}  // namespace

std::string priority_problem(int priority) {
  if (priority < 0 && ::geteuid() != 0)
    return str_cat("priority ", priority, " needs root (runs go at normal priority)");
  std::ifstream f("/proc/sys/kernel/sched_autogroup_enabled");
  int on = 0;
  if (f >> on && on == 1 && !std::ifstream("/proc/self/autogroup"))
    return "autogroup scheduling is on but /proc/self/autogroup cannot be read (only the runs' own nice value is set)";
  return "";
}

LaunchResult run_command(const std::string& cmd, const std::string& log_path, double timeout_s,
                         const std::map<std::string, std::string>& env, std::optional<int> priority) {
  forward_interrupts();
  const double cpu0 = children_cpu_s();
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid < 0) fail(ErrorKind::Internal, "sweep: fork failed");
  if (pid == 0) {
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::signal(sig, SIG_DFL);
    exec_child(cmd, log_path, env, priority);
  }
  // Until the child's setsid() the group does not exist: wait for it, so that a kill cannot miss it.
  for (int i = 0; i < 1000 && ::getpgid(pid) != pid; ++i) std::this_thread::sleep_for(std::chrono::microseconds(100));
  running_group = pid;
  LaunchResult r;
  r.limit_s = timeout_s;
  int status = 0;
  const auto limit = start + std::chrono::duration<double>(timeout_s);
  for (;;) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0) fail(ErrorKind::Internal, "sweep: waitpid failed");
    if (std::chrono::steady_clock::now() >= limit) {
      r.timed_out = true;
      kill_group(pid, &status);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  running_group = 0;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  r.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (const double cpu1 = children_cpu_s(); cpu0 >= 0 && cpu1 >= 0) r.cpu_s = cpu1 - cpu0;
  return r;
}

}  // namespace xirang::analysis::sweep
