// FieldCheck: the rule one config value meets on its own (a column of the
// schema's rows, runtime/config/field_check.h), and its message: the key,
// the value as the file spells it, and the rule with its bound.
#include "runtime/config/field_check.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "core/error.h"

namespace xirang {
namespace {

TEST(FieldCheck, BoundsAndTheirEnds) {
  // At the bound: AtLeast holds, Above does not.
  EXPECT_EQ(field_problem(AtLeast{1}, "a.n", int64_t{1}), "");
  EXPECT_EQ(field_problem(AtLeast{1}, "a.n", int64_t{0}), "a.n=0 must be >= 1");
  EXPECT_EQ(field_problem(AtLeast{0, " (0 disables it)"}, "a.n", int64_t{-3}), "a.n=-3 must be >= 0 (0 disables it)");
  EXPECT_EQ(field_problem(Above{1}, "a.x", 1.0), "a.x=1 must be > 1");
  EXPECT_EQ(field_problem(Above{1}, "a.x", 1.0000001), "");
  EXPECT_EQ(field_problem(Positive, "a.x", 0.0), "a.x=0 must be > 0");
  EXPECT_EQ(field_problem(Positive, "a.x", 1e-300), "");
  EXPECT_EQ(field_problem(AtLeast{0}, "a.x", -0.5), "a.x=-0.5 must be >= 0");
  // Each end of a Within range, in and out.
  struct Case {
    Ends ends;
    const char* text;
    bool lo_in, hi_in;
  };
  for (const Case& c : {Case{Ends::Closed, "[0, 1]", true, true}, Case{Ends::ClosedOpen, "[0, 1)", true, false},
                        Case{Ends::OpenClosed, "(0, 1]", false, true}, Case{Ends::Open, "(0, 1)", false, false}}) {
    SCOPED_TRACE(c.text);
    const Within w{0, 1, c.ends};
    EXPECT_EQ(field_problem(w, "a.r", 0.0).empty(), c.lo_in);
    EXPECT_EQ(field_problem(w, "a.r", 1.0).empty(), c.hi_in);
    EXPECT_EQ(field_problem(w, "a.r", 0.5), "");
    EXPECT_EQ(field_problem(w, "a.r", 1.5), std::string("a.r=1.5 must be in ") + c.text);
    EXPECT_EQ(field_problem(w, "a.r", -1e-9), std::string("a.r=-1.0e-09 must be in ") + c.text);
  }
  // An integer's range of two values reads as the two values.
  EXPECT_EQ(field_problem(Within{0, 1}, "p.zero", int64_t{2}), "p.zero=2 must be 0 or 1");
  EXPECT_EQ(field_problem(Within{0, 1}, "p.zero", int64_t{1}), "");
  EXPECT_EQ(field_problem(Within{1, 8}, "p.n", int64_t{9}), "p.n=9 must be in [1, 8]");
}

// A NaN set from code breaks every numeric rule.
TEST(FieldCheck, NanBreaksEveryNumericRule) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_NE(field_problem(AtLeast{0}, "a.x", nan), "");
  EXPECT_NE(field_problem(Above{0}, "a.x", nan), "");
  EXPECT_NE(field_problem(Within{0, 1}, "a.x", nan), "");
  EXPECT_EQ(field_problem(std::monostate{}, "a.x", nan), "");
}

TEST(FieldCheck, TextRules) {
  EXPECT_EQ(field_problem(NotEmpty{"it names the job"}, "m.job", std::string()), "m.job is empty: it names the job");
  EXPECT_EQ(field_problem(NotEmpty{"it names the job"}, "m.job", std::string("x")), "");
  const FieldCheck endpoint = TextRule{host_port_problem};
  EXPECT_EQ(field_problem(endpoint, "m.p", std::string()), "");  // none
  EXPECT_EQ(field_problem(endpoint, "m.p", std::string("127.0.0.1:9400")), "");
  EXPECT_EQ(field_problem(endpoint, "m.p", std::string("host:65535")), "");
  for (const char* bad : {"localhost", ":9400", "h:0", "h:65536", "h:", "h:12a"})
    EXPECT_EQ(field_problem(endpoint, "m.p", std::string(bad)),
              std::string("m.p='") + bad + "' is not HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:9400)");
}

// A rule on the wrong kind of value is a schema bug, never a silent pass.
TEST(FieldCheck, RuleOfTheWrongKindIsAnInternalError) {
  try {
    field_problem(AtLeast{1}, "a.s", std::string("x"));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Internal);
  }
  try {
    field_problem(NotEmpty{"x"}, "a.n", int64_t{1});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Internal);
  }
}

}  // namespace
}  // namespace xirang
