// The command line of engine_run (ExecuTorch) and engine_pipe (a runner over a pipe): an
// edgemtp::Engine opened on a bundle, one or more generations, one JSON line.
//
//   PROGRAM --bundle DIR (--prompt TEXT | --ids 1,2,3) [--then TEXT | --then-ids 4,5 |
//           --next-ids 1,2,...]... [--depth N] [--tokens N] [--chat] [--temperature T]
//           [--top-k K] [--top-p P] [--min-p P] [--seed S] [--no-stop]
//
// --depth: -1 adaptive (the default), 0 AR, k pinned drafts per round. Each --then / --then-ids
// is one more turn whose prompt is the previous turn's prompt, its tokens and these (text
// encoded without special tokens): a chat, where the engine reuses the cache of the turns
// before. --next-ids: one more turn with exactly these prompt ids (the engine reuses what the
// cache shares with them). --no-stop: no stop ids (generate exactly --tokens).
//
// Prints one JSON line: the last generation's prompt_tokens, reused_tokens, tokens, text,
// streamed (the text as on_text delivered it), stop_reason and stats, plus "turns" (every
// generation, in order) when there are several. Exit 1 with the Error's one line on stderr;
// 2: usage.
#include "engine_cli.h"

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "edgemtp/engine.h"
#include "edgemtp/json.h"

namespace {

using edgemtp::json::Array;
using edgemtp::json::Object;
using edgemtp::json::Value;

struct Turn {
  enum class Kind { kAppendText, kAppendIds, kIds } kind = Kind::kIds;
  std::string text;
  std::vector<int> ids;
};

struct Args {
  std::string bundle, prompt;
  std::vector<int> ids;
  bool has_prompt = false, has_ids = false;
  std::vector<Turn> turns;  // after the first
  edgemtp::GenerateOptions options;
};

std::string program_name = "engine";

[[noreturn]] void usage(const std::string& why) {
  std::cerr << program_name << ": " << why << "\nusage: " << program_name
            << " --bundle DIR (--prompt TEXT | --ids 1,2,3) [--then TEXT | "
               "--then-ids 4,5 | --next-ids 1,2,...]... [--depth N] [--tokens N] [--chat] "
               "[--temperature T] [--top-k K] [--top-p P] [--min-p P] [--seed S] [--no-stop]\n";
  std::exit(2);
}

std::vector<int> parse_ids(const std::string& text) {
  std::vector<int> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(start, end - start);
    if (item.empty() || item.find_first_not_of("0123456789") != std::string::npos ||
        item.size() > 9) {
      usage("bad id list '" + text + "'");
    }
    out.push_back(std::stoi(item));
    start = end + 1;
  }
  return out;
}

double parse_number(const std::string& text, const std::string& flag) {
  char* end = nullptr;
  const double x = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0') usage(flag + ": not a number: '" + text + "'");
  return x;
}

int integer(const std::string& text, const std::string& flag) {
  const double x = parse_number(text, flag);
  if (x != static_cast<int>(x)) usage(flag + ": not an integer: '" + text + "'");
  return static_cast<int>(x);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    const auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "--bundle") {
      a.bundle = value();
    } else if (flag == "--prompt") {
      a.prompt = value();
      a.has_prompt = true;
    } else if (flag == "--ids") {
      a.ids = parse_ids(value());
      a.has_ids = true;
    } else if (flag == "--then") {
      a.turns.push_back({Turn::Kind::kAppendText, value(), {}});
    } else if (flag == "--then-ids") {
      a.turns.push_back({Turn::Kind::kAppendIds, "", parse_ids(value())});
    } else if (flag == "--next-ids") {
      a.turns.push_back({Turn::Kind::kIds, "", parse_ids(value())});
    } else if (flag == "--depth") {
      a.options.depth = integer(value(), flag);
    } else if (flag == "--tokens") {
      a.options.max_new_tokens = integer(value(), flag);
    } else if (flag == "--chat") {
      a.options.chat = true;
    } else if (flag == "--temperature") {
      a.options.sampling.temperature = parse_number(value(), flag);
    } else if (flag == "--top-k") {
      a.options.sampling.top_k = integer(value(), flag);
    } else if (flag == "--top-p") {
      a.options.sampling.top_p = parse_number(value(), flag);
    } else if (flag == "--min-p") {
      a.options.sampling.min_p = parse_number(value(), flag);
    } else if (flag == "--seed") {
      a.options.sampling.seed = static_cast<uint64_t>(integer(value(), flag));
    } else if (flag == "--no-stop") {
      a.options.stop_ids = {-1};  // matches no token
    } else {
      usage("unknown option " + flag);
    }
  }
  if (a.bundle.empty()) usage("--bundle is required");
  if (a.has_prompt == a.has_ids) usage("give exactly one of --prompt and --ids");
  return a;
}

Value int_array(const std::vector<int>& values) {
  Array out;
  for (int x : values) out.emplace_back(x);
  return Value(std::move(out));
}

Value report(const edgemtp::GenerateStats& s, const std::string& streamed) {
  Array rounds;
  for (const auto& [drafted, accepted] : s.rounds) rounds.emplace_back(Array{drafted, accepted});
  Object phases;
  for (const auto& [phase, seconds] : s.seconds_by_phase) phases[phase] = Value(seconds);
  return Value(Object{
      {"prompt_tokens", Value(s.prompt_tokens)},
      {"reused_tokens", Value(s.reused_tokens)},
      {"tokens", int_array(s.tokens)},
      {"text", Value(s.text)},
      {"streamed", Value(streamed)},
      {"stop_reason", Value(s.stop_reason)},
      {"stats", Value(Object{
                    {"ttft_s", Value(s.ttft_s)},
                    {"decode_s", Value(s.decode_s)},
                    {"prefill_tok_s", Value(s.prefill_tok_s())},
                    {"decode_tok_s", Value(s.decode_tok_s())},
                    {"acceptance", Value(s.acceptance())},
                    {"rounds", Value(std::move(rounds))},
                    {"seconds_by_phase", Value(std::move(phases))},
                })},
  });
}

}  // namespace

namespace edgemtp {

int run_engine_cli(int argc, char** argv, const std::string& name,
                   const RunnerFactory& make_runner) {
  program_name = name;
  Args args = parse(argc, argv);
  try {
    const edgemtp::BundleConfig bundle = edgemtp::read_bundle_config(args.bundle);
    std::unique_ptr<edgemtp::MethodRunner> runner = make_runner(args.bundle, bundle);
    edgemtp::Engine engine(args.bundle, *runner);

    std::string streamed;
    edgemtp::GenerateOptions options = args.options;
    options.on_text = [&](const std::string& text, const std::vector<int>&) { streamed += text; };

    std::vector<int> prompt =
        args.has_ids ? args.ids : engine.tokenizer().encode_prompt(args.prompt, options.chat);
    Array turns;
    edgemtp::GenerateStats stats = engine.generate(prompt, options);
    turns.push_back(report(stats, streamed));
    for (const Turn& turn : args.turns) {
      if (turn.kind == Turn::Kind::kIds) {
        prompt = turn.ids;
      } else {
        prompt.insert(prompt.end(), stats.tokens.begin(), stats.tokens.end());
        std::vector<int> more = turn.kind == Turn::Kind::kAppendIds
                                    ? turn.ids
                                    : engine.tokenizer().encode(turn.text, false);
        prompt.insert(prompt.end(), more.begin(), more.end());
      }
      streamed.clear();
      stats = engine.generate(prompt, options);
      turns.push_back(report(stats, streamed));
    }
    Value out = turns.back();
    if (turns.size() > 1) {
      Object object = out.as_object();
      object["turns"] = Value(std::move(turns));
      out = Value(std::move(object));
    }
    std::cout << out.dump() << std::endl;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace edgemtp
