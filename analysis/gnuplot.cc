#include "analysis/gnuplot.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace xirang::analysis {

namespace fs = std::filesystem;

std::string find_gnuplot() {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  for (std::string d; std::getline(dirs, d, ':');) {
    const fs::path p = fs::path(d.empty() ? "." : d) / "gnuplot";
    if (::access(p.c_str(), X_OK) == 0) return p.string();
  }
  return {};
}

std::string gnuplot_quote(const std::string& s) {
  std::string r = "'";
  for (char c : s) r += c == '\'' ? std::string("''") : std::string(1, c);
  return r + "'";
}

std::string shell_word(const std::string& s) {
  std::string r = "'";
  for (char c : s) r += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return r + "'";
}

std::string run_gnuplot_script(const std::string& gnuplot, const std::string& script, const std::string& cwd) {
  // Absolute: the command changes into `cwd` before the redirection opens it.
  const std::string err = fs::absolute((cwd.empty() ? fs::path(script).parent_path() : fs::path(cwd)) / "gnuplot.err");
  std::string cmd = shell_word(gnuplot) + " " + shell_word(script) + " 2>" + shell_word(err);
  if (!cwd.empty()) cmd = "cd " + shell_word(cwd) + " && " + cmd;
  const int rc = std::system(cmd.c_str());
  std::error_code ec;
  if (rc == 0) {
    fs::remove(err, ec);
    return {};
  }
  std::string first;
  std::ifstream e(err);
  while (first.find_first_not_of(" \t^") == std::string::npos && std::getline(e, first)) {}
  fs::remove(err, ec);
  return "gnuplot failed (exit status " + std::to_string(WIFEXITED(rc) ? WEXITSTATUS(rc) : rc) + "): " + first;
}

}  // namespace xirang::analysis
