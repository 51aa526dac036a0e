// analysis/gnuplot.h: running Debian's gnuplot for the report's and the
// sweep's plots. The plots themselves are gnuplot scripts the callers
// write; this finds the program, quotes strings for its scripts, and runs
// one script, turning a failure into one line of reason.
//
//   std::string gp = find_gnuplot();                 // empty: not installed
//   std::string why = run_gnuplot_script(gp, "plots.gp", dir);  // empty: done
#pragma once

#include <string>

namespace xirang::analysis {

// The first executable `gnuplot` on PATH, or empty.
std::string find_gnuplot();
// A gnuplot single-quoted string ('' stands for a quote).
std::string gnuplot_quote(const std::string& s);
// A single-quoted word for sh.
std::string shell_word(const std::string& s);
// Runs `gnuplot SCRIPT` in directory `cwd` (empty: the current one); empty
// on success, else "gnuplot failed (exit status N): <its first error line>".
std::string run_gnuplot_script(const std::string& gnuplot, const std::string& script, const std::string& cwd = "");

}  // namespace xirang::analysis
